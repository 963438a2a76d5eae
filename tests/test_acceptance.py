"""Acceptance rules: greedy matches argmax decoding; rejection sampling reproduces the target distribution."""

from __future__ import annotations

import torch
from helpers.stats import chi_square_p_value

from trtllm_dustin.runtime.acceptors import greedy_accept, rejection_accept
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling

PARAMS = SamplingParams(temperature=1.0)


def test_greedy_accepts_the_matching_prefix_and_appends_the_target_token() -> None:
    V = 10
    target_pred = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(target_pred, V).float() * 5 + torch.randn(4, 4, V) * 0.01
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [7, 4, 5], [1, 1, 1]])  # ragged: 3, 1, 0 and all accepted
    accepted, nxt = greedy_accept(drafts, logits)
    assert accepted.tolist() == [3, 1, 0, 3]
    assert nxt.tolist() == [6, 4, 3, 1]


def draws(p_logits: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n independent rounds with Γ = 2: drafts sampled from q, verified against p. Returns (accepted, committed)."""
    gen = torch.Generator().manual_seed(seed)
    gamma, V = q.shape
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(gamma)], 1)
    sampling = SlotSampling([PARAMS] * n, gen, torch.device("cpu"))
    accepted, nxt = rejection_accept(drafts, q.expand(n, gamma, V), p_logits.expand(n, gamma + 1, V), sampling)
    committed = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, accepted[:, None], nxt[:, None])
    return accepted, committed


def test_rejection_sampling_reproduces_the_target_distribution() -> None:
    torch.manual_seed(0)
    V, n = 9, 60000
    p_logits = torch.randn(3, V) * 1.5
    q = torch.softmax(torch.randn(2, V) * 1.5, dim=-1)
    accepted, committed = draws(p_logits, q, n, seed=1)
    p = torch.softmax(p_logits, -1).double()
    # The first committed token is always a target sample, whatever was accepted.
    assert chi_square_p_value(torch.bincount(committed[:, 0], minlength=V).double(), p[0]) > 1e-3
    # Given the first draft was accepted, the second committed token follows p_1 (same target context here).
    second = committed[accepted >= 1, 1]
    assert chi_square_p_value(torch.bincount(second, minlength=V).double(), p[1]) > 1e-3
    assert 0 < (accepted == 2).sum() < n and (accepted == 0).sum() > 0  # every branch was exercised


def test_one_hot_target_is_reproduced_exactly() -> None:
    V, n = 7, 2000
    p_logits = torch.full((3, V), -1e9)
    p_logits[:, 4] = 0.0
    q = torch.softmax(torch.randn(2, V), dim=-1)
    accepted, committed = draws(p_logits, q, n, seed=2)
    rows = torch.arange(n)
    assert bool((committed[rows, 0] == 4).all())
    assert bool((committed[accepted >= 1, 1] == 4).all())


def test_draft_equal_to_target_accepts_everything() -> None:
    V, n = 11, 500
    p_logits = torch.randn(3, V)
    q = torch.softmax(p_logits[:2], dim=-1)
    accepted, _ = draws(p_logits, q, n, seed=3)
    assert bool((accepted == 2).all())
