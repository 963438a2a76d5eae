"""The Acceptor seam: how a round's verdict is reached from the drafted tokens and the target's logits.

Every acceptor returns, per slot, the number a of accepted draft tokens (0 .. Γ) and the token that follows them
(the target's correction, or its bonus token when all Γ were accepted): a + 1 tokens commit. Implementations
(acceptors/): greedy.py (the output equals plain greedy decoding), rejection.py (speculative rejection sampling:
the committed tokens are distributed as target samples; greedy slots of a mixed batch stay greedy) and
teacher_forced.py (quality evaluation: the drafts are checked against the true continuation). The benchmarks'
stated-distribution acceptance for random weights lives in benchmarks/stated_acceptance.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["Acceptor", "Verdict"]


@dataclass
class Verdict:
    accepted: torch.Tensor  # int64 [B]: accepted draft tokens, 0 .. Γ
    next_tokens: torch.Tensor  # int64 [B]: the token after them


class Acceptor(Protocol):
    def accept(self, proposal: Proposal, target_logits: torch.Tensor, progress: Progress,
               sampling: SlotSampling) -> Verdict:
        """target_logits [B, Γ + 1, V] (position i predicts the token after the round's i-th token) -> Verdict."""
