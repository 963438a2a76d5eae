"""MagicDec's draft attention: only a StreamingLLM set, the first n_sink positions and the most recent
budget - n_sink, so the draft's cost stops growing with the context (the target still verifies in full)."""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionMetadata
from trtllm_dustin.config import ConfigError
from trtllm_dustin.plugins.selection import streaming_indices
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.state import Observation

__all__ = ["StreamingWindowView"]


class StreamingWindowView:
    def __init__(self, budget: int, n_sink: int = 4) -> None:
        if budget <= n_sink:
            raise ConfigError(f"draft KV budget {budget} must exceed the {n_sink} sink tokens; raise --draft-budget")
        self.budget, self.n_sink = budget, n_sink

    def metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(cache_seqlens=lens, indices=streaming_indices(lens, self.budget, self.n_sink))

    def on_prefill(self, view: PrefillView) -> None:
        """The window follows L_b; nothing kept."""

    def observe(self, seen: Observation) -> None:
        """The window follows L_b; nothing kept."""
