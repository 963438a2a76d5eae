"""Token sampling: greedy, temperature and nucleus (top-p), batched, seeded, without host syncs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_dustin.plugins.argmax import argmax_last

__all__ = ["SamplingParams", "sample", "sampling_probs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1 keeps the whole distribution
    seed: int = 0  # seeds the sampling generator of a generate() call

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) restricted to the top-p nucleus, renormalised. [.., V]"""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    if params.greedy:
        return argmax_last(logits)
    probs = sampling_probs(logits, params)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, with no host sync.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)
