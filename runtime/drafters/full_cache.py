"""Classic SD's draft attention: the draft model reads its whole cache [0, L_b + t] at every step."""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionMetadata
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.state import Observation

__all__ = ["FullCacheView"]


class FullCacheView:
    def metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(cache_seqlens=lens)

    def on_prefill(self, view: PrefillView) -> None:
        """Nothing kept."""

    def observe(self, seen: Observation) -> None:
        """Nothing kept."""
