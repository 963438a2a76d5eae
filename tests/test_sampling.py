"""Sampling follows the distribution it claims (chi-square), greedy is argmax, top-p keeps the nucleus."""

from __future__ import annotations

import pytest
import torch
from helpers.stats import chi_square_p_value

from trtllm_dustin.runtime.acceptors import RejectionAcceptor, rejection_accept
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling, sampling_probs

CPU = torch.device("cpu")


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_samples_follow_the_distribution(temperature: float, top_p: float) -> None:
    torch.manual_seed(0)
    V, N = 11, 40000
    logits = torch.randn(V) * 1.5
    params = SamplingParams(temperature, top_p, seed=1)
    probs = sampling_probs(logits, params)
    draws = SlotSampling.batch(params, N, CPU, use_kernel=False).pick(logits.expand(N, V))
    counts = torch.bincount(draws, minlength=V).double()
    assert counts[probs == 0].sum() == 0  # nothing outside the nucleus
    assert chi_square_p_value(counts, probs.double()) > 1e-3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = sampling_probs(logits, SamplingParams(1.0, 0.75))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = sampling_probs(logits, SamplingParams(1.0, 0.1))  # the top token always stays
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_greedy_is_argmax_and_seeded_sampling_repeats() -> None:
    logits = torch.randn(7, 50)
    assert torch.equal(SlotSampling.batch(SamplingParams(), 7, CPU).pick(logits), logits.argmax(-1))
    p = SamplingParams(1.0, 0.9, seed=5)
    a = SlotSampling.batch(p, 7, CPU).pick(logits)
    b = SlotSampling.batch(p, 7, CPU).pick(logits)
    assert torch.equal(a, b)


def test_invalid_params() -> None:
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)


# ---- per-slot sampling (in-flight serving) -----------------------------------------------------------------------
SLOTS = [SamplingParams(0.8, 0.9, seed=3), SamplingParams(), None, SamplingParams(1.3, 1.0, seed=8)]


def _per_slot() -> SlotSampling:
    return SlotSampling(SLOTS, [torch.Generator().manual_seed(p.seed) if p and not p.greedy else None for p in SLOTS],
                        CPU)


def test_a_slot_samples_what_a_one_slot_batch_with_its_generator_samples() -> None:
    """The invariant in-flight serving rests on: per-slot draws (pick, then rejection sampling) of a sampled slot
    equal those of a one-slot batch seeded the same, whatever shares the batch; greedy and idle slots take argmax."""
    torch.manual_seed(1)
    V, gamma = 40, 3
    logits = torch.randn(len(SLOTS), V) * 2
    drafts = torch.randint(0, V, (len(SLOTS), gamma))
    q = torch.softmax(torch.randn(len(SLOTS), gamma, V), -1)
    target = torch.randn(len(SLOTS), gamma + 1, V) * 2
    batch = _per_slot()
    picked = batch.pick(logits)
    accepted, nxt = rejection_accept(drafts, q, target, batch)
    for b, params in enumerate(SLOTS):
        if params is None or params.greedy:
            assert int(picked[b]) == int(logits[b].argmax())
            continue
        alone = SlotSampling.batch(params, 1, CPU)
        assert int(picked[b]) == int(alone.pick(logits[b: b + 1])[0])
        a, n = rejection_accept(drafts[b: b + 1], q[b: b + 1], target[b: b + 1], alone)
        assert (int(accepted[b]), int(nxt[b])) == (int(a[0]), int(n[0]))
    torch.testing.assert_close(batch.probs(logits)[0], sampling_probs(logits[0], SLOTS[0]), rtol=0, atol=0)


def test_per_slot_rows_follow_their_own_distributions() -> None:
    """N slots with their own generators (and their own temperature / top-p) each draw from their own distribution."""
    V, N = 9, 20000
    torch.manual_seed(2)
    row = torch.randn(V) * 1.5
    for p in (SamplingParams(0.6, 1.0, seed=1), SamplingParams(1.4, 0.7, seed=2)):
        batch = SlotSampling([p] * N, [torch.Generator().manual_seed(p.seed * N + i) for i in range(N)], CPU,
                             use_kernel=False)
        draws = batch.pick(row.expand(N, V))
        probs = sampling_probs(row, p).double()
        counts = torch.bincount(draws, minlength=V).double()
        assert counts[probs == 0].sum() == 0 and chi_square_p_value(counts, probs) > 1e-3


def test_rejection_acceptor_keeps_greedy_slots_greedy() -> None:
    torch.manual_seed(3)
    V, gamma = 30, 3
    batch = _per_slot()
    target = torch.randn(len(SLOTS), gamma + 1, V) * 3
    drafts = target[:, :gamma].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # slot 1 (greedy) must stop after one accepted draft
    q = torch.softmax(torch.randn(len(SLOTS), gamma, V), -1)
    verdict = RejectionAcceptor().accept(Proposal(drafts, q), target, None, batch)
    assert int(verdict.accepted[1]) == 1 and int(verdict.next_tokens[1]) == int(target[1, 1].argmax())
    assert int(verdict.accepted[2]) == gamma and int(verdict.next_tokens[2]) == int(target[2, gamma].argmax())


def test_slot_sampling_refuses_a_sampled_slot_without_a_generator() -> None:
    with pytest.raises(ValueError, match=r"sampled slots \[0\] have no generator"):
        SlotSampling([SamplingParams(1.0)], [None], CPU)
