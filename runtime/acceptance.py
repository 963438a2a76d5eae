"""Accepting draft tokens: greedy matching and speculative rejection sampling, batched with no host sync.

Both return, per sequence, the number a of accepted draft tokens (0..Γ) and the token that follows
them (the target's correction, or its bonus token when all Γ were accepted): a + 1 tokens commit.
"""

from __future__ import annotations

import torch

from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.sampling import SamplingParams, sampling_probs

__all__ = ["greedy_accept", "greedy_accept_ids", "rejection_accept"]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, Γ] bool -> [B] int64: length of each row's leading run of True."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, Γ], target_logits [B, Γ+1, V] -> (accepted [B], next_token [B]).

    Draft token i+1 is accepted while it equals the target's argmax after position i; the next token is
    the target's argmax after the last accepted one, so the output equals plain greedy decoding.
    """
    return greedy_accept_ids(draft_tokens, argmax_last(target_logits))


def greedy_accept_ids(draft_tokens: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_accept from the target's argmax ids [B, Γ+1] (for callers that need the ids too)."""
    accepted = _leading_true(draft_tokens == target_ids[:, :-1])
    return accepted, target_ids.gather(1, accepted[:, None])[:, 0]


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     params: SamplingParams, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling; the committed tokens are distributed exactly as target samples.

    draft_tokens [B, Γ] were sampled from draft_probs [B, Γ, V]; target_logits [B, Γ+1, V]. Token i+1 is
    accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the next token is drawn from
    normalise(max(p_i - q_i, 0)); when all are accepted it is drawn from p_Γ.
    """
    B, gamma = draft_tokens.shape
    p = sampling_probs(target_logits, params)  # [B, Γ+1, V]
    p_x = p[:, :-1].gather(2, draft_tokens[..., None])[..., 0]  # [B, Γ]
    q_x = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    u = torch.rand(B, gamma, device=p.device, generator=generator)
    accepted = _leading_true(u * q_x < p_x)  # u < p/q without dividing by a zero q
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]  # q_Γ := 0
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; then any rejection had probability 0, so p itself is right.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)
    race = torch.empty_like(residual).exponential_(generator=generator)
    return accepted, (residual / race).argmax(dim=-1)
