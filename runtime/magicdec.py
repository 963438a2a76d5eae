"""MagicDec: the draft attends only to a StreamingLLM window (sinks + most recent), the target verifies in full.

Its draft cost stops growing with the context; the target's verification still reads the whole cache.
"""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionMetadata
from trtllm_dustin.runtime.speculative import SpeculativeDecoder

__all__ = ["MagicDec"]


class MagicDec(SpeculativeDecoder):
    name = "magicdec"

    def __init__(self, *args, draft_budget: int = 512, n_sink: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if draft_budget <= n_sink:
            raise ValueError(f"draft KV budget {draft_budget} must exceed the {n_sink} sink tokens")
        self.draft_budget, self.n_sink = draft_budget, n_sink

    def draft_metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        from trtllm_dustin.plugins import streaming_indices

        return AttentionMetadata(cache_seqlens=lens, indices=streaming_indices(lens, self.draft_budget, self.n_sink))
