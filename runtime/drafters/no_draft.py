"""No draft: Γ = 0, so a round verifies only the last committed token and commits the target's next one. That is
plain (vanilla) decoding, run by the same round as every speculative method."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView, Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["NoDraft"]


class NoDraft:
    gamma = 0
    target_query_layers: tuple[int, ...] = ()
    target_hidden_layers: tuple[int, ...] = ()
    window_layers: tuple[int, ...] = ()
    window_rows: int = 0

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        self.tokens = torch.zeros(slots, 0, dtype=torch.long, device=device)
        self.probs = torch.zeros(slots, 0, vocab_size, dtype=torch.float32, device=device)

    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0
                ) -> None:  # no job
        """Nothing to prefill."""

    def on_prefill(self, view: PrefillView) -> None:
        """No prompt-time state."""

    def lookahead(self, layers: Sequence[int], confidence: bool = False) -> Lookahead:
        raise ConfigError("vanilla decoding has no draft, so there is no lookahead to score; choose a method with a "
                          "draft model")

    def propose(self, state: RoundState, sampling: SlotSampling, rows: slice | None = None) -> Proposal:
        return Proposal(self.tokens, None if sampling.all_greedy else self.probs)

    def observe(self, seen: Observation) -> None:
        """Nothing to keep."""

    def capture(self, state: RoundState, greedy: bool) -> Proposal:
        """No steps to capture."""
        return Proposal(self.tokens, None if greedy else self.probs)
