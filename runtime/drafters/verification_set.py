"""Sparse drafting (beyond the paper): the draft reads only the verification set, like the target.

At 32K the draft's Γ full-cache steps dominate a Dustin round. Here every draft layer attends to the I_verify
chosen in the previous round, plus the positions committed since that selection, plus its own new tokens; the
draft's SRH layers still score against their full keys (the estimate is unchanged), so the next I_verify still
sees the whole context. A newly admitted slot, before any selection, uses StreamingLLM's set.
"""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionMetadata
from trtllm_dustin.config import ConfigError
from trtllm_dustin.plugins.selection import streaming_indices
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.state import Observation

__all__ = ["VerificationSetView"]


class VerificationSetView:
    def __init__(self, budget: int, n_sink: int, gamma: int, slots: int, device: torch.device) -> None:
        if not 0 <= n_sink < budget:
            raise ConfigError(f"sparse drafting: n_sink={n_sink} must lie in [0, budget k={budget})")
        self.budget, self.n_sink = budget, n_sink
        self.chosen = torch.full((slots, budget), -1, dtype=torch.int32, device=device)  # the last I_verify
        self.selected_at = torch.zeros(slots, dtype=torch.int32, device=device)  # L_b when it was chosen
        # Positions committed since the selection: at most Γ + 1 last round, plus Γ - 1 drafted before the last step.
        self._gap = torch.arange(2 * gamma + 1, device=device)

    def metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        gap = self.selected_at[:, None] + self._gap[None]  # [B, 2Γ+1] positions in [selected_at, lens)
        gap = torch.where(gap < lens[:, None], gap, -1).to(torch.int32)
        return AttentionMetadata(cache_seqlens=lens, indices=torch.cat([self.chosen, gap], dim=1))

    def on_prefill(self, view: PrefillView) -> None:
        self.chosen[view.slots] = streaming_indices(view.lengths, self.budget, self.n_sink)
        self.selected_at[view.slots] = view.lengths

    def observe(self, seen: Observation) -> None:
        if seen.indices is None:
            raise ConfigError("sparse drafting reads the verification set, but this method verifies in full; pair it "
                              "with a sparse selector")
        self.chosen.copy_(seen.indices)
        self.selected_at.copy_(seen.lengths)
