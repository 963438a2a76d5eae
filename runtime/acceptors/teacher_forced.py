"""Teacher-forced acceptance (quality evaluation): the drafts are checked against the true continuation.

The accepted prefix is the drafts that equal the text, and the committed token is the text's own, so every
method follows the same text; the target's log-probabilities at the verified positions up to the first mismatch
(exactly one per position of the text) are recorded, for next-token accuracy and KL against full verification.
"""

from __future__ import annotations

import torch

from trtllm_dustin.runtime.acceptor import Verdict
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["TeacherForcedAcceptor"]


class TeacherForcedAcceptor:
    def __init__(self, teacher: torch.Tensor, logprobs: torch.Tensor) -> None:
        """teacher int64 [B, n + Γ + 1]: the continuation (-1 padded); logprobs fp32 [B, n, V] receives, at text
        position j, the target's log-probabilities of token j (position 0, from the prefill, is the caller's)."""
        if teacher.shape[0] != logprobs.shape[0] or teacher.shape[1] <= logprobs.shape[1]:
            raise ValueError(f"teacher {tuple(teacher.shape)} must cover the {logprobs.shape[1]} positions of "
                             f"logprobs {tuple(logprobs.shape)} plus the round's lookahead")
        self.teacher, self.logprobs = teacher, logprobs

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, progress: Progress,
               sampling: SlotSampling) -> Verdict:
        tokens, n = proposal.tokens, self.logprobs.shape[1]
        gamma = tokens.shape[1]
        positions = torch.arange(gamma + 1, device=tokens.device)
        cols = progress.generated[:, None] + positions[None]  # [B, Γ+1]: slot i predicts text position cols[:, i]
        truth = self.teacher.gather(1, cols)
        accepted = (tokens == truth[:, :gamma]).long().cumprod(1).sum(1)
        keep = (positions[None] <= accepted[:, None]) & (cols < n) & progress.active[:, None]
        # Evaluation, not timing: the boolean indexing syncs with the host.
        self.logprobs[keep.nonzero(as_tuple=True)[0], cols[keep]] = torch.log_softmax(target_logits.float(), -1)[keep]
        return Verdict(accepted, truth.gather(1, accepted[:, None])[:, 0].clamp_min(0))
