"""Full verification: the target reads its whole cache (vanilla, Classic SD, MagicDec)."""

from __future__ import annotations

import torch

from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation

__all__ = ["FullVerification"]


class FullVerification(Selector):
    budget = None
    in_pass = None  # no selection inside the verification pass
    target_query_layers: tuple[int, ...] = ()

    def on_prefill(self, view: PrefillView) -> None:
        """No prompt-time state."""

    def estimate(self, lengths: torch.Tensor) -> None:
        return None

    def select(self, lengths: torch.Tensor, scores: None) -> None:
        return None

    def observe(self, seen: Observation) -> None:
        """Nothing kept."""

    def draft_share(self) -> None:
        return None
