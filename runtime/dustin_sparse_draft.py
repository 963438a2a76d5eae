"""Dustin with sparse drafting (beyond the paper): the draft also reads only the verification set.

At 32K the draft's Γ full-cache steps dominate a Dustin round. Here every draft layer attends to the
I_verify chosen in the previous round, plus the positions committed since that selection, plus its own
new tokens; its SRH layers still score against their full keys (the estimate is unchanged), so the next
I_verify still sees the whole context. The first round, before any selection, uses StreamingLLM's set.
"""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionMetadata
from trtllm_dustin.runtime.dustin import Dustin

__all__ = ["DustinSparseDraft"]


class DustinSparseDraft(Dustin):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = f"dustin-{self.variant}-sparse-draft"
        self.selected_at = torch.zeros_like(self.tcache.seqlens)  # L when self.indices was chosen
        # Positions committed since the selection: at most Γ+1 last round, plus Γ-1 drafted before the last step.
        self._gap = torch.arange(2 * self.gamma + 1, device=self.device)

    def draft_metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        gap = self.selected_at[:, None] + self._gap[None]  # [B, 2Γ+1] positions in [selected_at, lens)
        gap = torch.where(gap < lens[:, None], gap, -1).to(torch.int32)
        return AttentionMetadata(cache_seqlens=lens, indices=torch.cat([self.indices, gap], dim=1))

    def after_prefill(self, last_queries: dict[int, torch.Tensor], batch: int) -> None:
        from trtllm_dustin.plugins import streaming_indices

        super().after_prefill(last_queries, batch)
        L = self.tcache.seqlens
        self.indices.copy_(streaming_indices(L, self.cfg.budget, self.cfg.n_sink))
        self.selected_at.copy_(L)

    def select(self) -> None:
        super().select()
        self.selected_at.copy_(self.tcache.seqlens)
