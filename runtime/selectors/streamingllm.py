"""StreamingLLM as a verification set: 4 sinks + the most recent k - 4 committed positions."""

from __future__ import annotations

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.plugins.selection import streaming_indices
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation

__all__ = ["StreamingLLMSelector"]


class StreamingLLMSelector(Selector):
    target_query_layers: tuple[int, ...] = ()

    def __init__(self, budget: int, n_sink: int, slots: int, device: torch.device) -> None:
        if not 0 <= n_sink < budget:
            raise ConfigError(f"streamingllm: n_sink={n_sink} must lie in [0, budget k={budget})")
        self.budget, self.n_sink = budget, n_sink
        self.in_pass = None
        self.indices = torch.full((slots, budget), -1, dtype=torch.int32, device=device)

    def on_prefill(self, view: PrefillView) -> None:
        """The set follows L_b; no prompt-time state."""

    def estimates(self) -> bool:
        return False

    def estimate(self, lengths: torch.Tensor) -> None:
        return None

    def select(self, lengths: torch.Tensor, scores: None) -> torch.Tensor:
        self.indices.copy_(streaming_indices(lengths, self.budget, self.n_sink))
        return self.indices

    def observe(self, seen: Observation) -> None:
        """Nothing kept."""

    def draft_share(self) -> None:
        return None
