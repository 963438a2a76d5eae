"""Classic speculative decoding: a full-cache draft proposes Γ tokens, the target verifies them on its full cache."""

from __future__ import annotations

from trtllm_dustin.runtime.speculative import SpeculativeDecoder

__all__ = ["ClassicSD"]


class ClassicSD(SpeculativeDecoder):
    """The shared round with every hook at its default: full draft attention, full verification."""

    name = "classic"
