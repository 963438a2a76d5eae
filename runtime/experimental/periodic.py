"""Periodic full verification (evaluation only; SpecPV's safety valve, arXiv 2512.02337): every `every`-th round
verifies against the whole cache instead of the inner selector's set, which otherwise runs as it is.

The choice is made on the host from a round count, so the selector cannot run inside captured phases: build.py
refuses it with CUDA graphs. Its cost per round is ((every - 1) x the sparse round + the full round) / every, which the
e2e benchmark's dustin-h and classic rows give.
"""

from __future__ import annotations

import torch

from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["PeriodicFullVerification"]


class PeriodicFullVerification(Selector):
    def __init__(self, inner: Selector, every: int) -> None:
        if every < 1:
            raise ValueError(f"periodic full verification: every={every} must be >= 1 (1: every round in full)")
        self.inner, self.every = inner, every
        self.budget = inner.budget
        self.in_pass = inner.in_pass
        self.target_query_layers = inner.target_query_layers
        self.rounds = 0  # rounds observed since the decoder was built

    def bind(self, state: RoundState) -> None:
        self.inner.bind(state)

    def on_prefill(self, view: PrefillView) -> None:
        self.inner.on_prefill(view)

    def estimates(self) -> bool:
        return self.inner.estimates()

    def estimate(self, lengths: torch.Tensor):
        return self.inner.estimate(lengths)

    def full_round(self) -> bool:
        """Whether the coming round verifies in full: rounds every, 2 x every, ... (counted from 1)."""
        return (self.rounds + 1) % self.every == 0

    def select(self, lengths: torch.Tensor, scores) -> torch.Tensor | None:
        indices = self.inner.select(lengths, scores)
        return None if self.full_round() else indices

    def observe(self, seen: Observation) -> None:
        self.inner.observe(seen)
        self.rounds += 1

    def draft_share(self) -> torch.Tensor | None:
        return self.inner.draft_share()
