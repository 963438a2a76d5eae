"""Acceptance at a stated mean accepted length, for speed benchmarks with random weights.

Random weights accept nothing useful, so a benchmark round commits accepted counts drawn from a stated
distribution (a truncated geometric with per-token acceptance alpha, solved so that E[accepted + 1] = tau) while
every kernel of the round, the target's whole verification included, runs for real. A benchmark concern only: the
runtime's acceptors are in runtime/acceptors/.
"""

from __future__ import annotations

import torch

from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.acceptor import Verdict
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["StatedAcceptor", "stated_acceptance"]


def stated_acceptance(tau: float, gamma: int) -> tuple[torch.Tensor, float]:
    """P(accepted = n), n = 0..Γ, for i.i.d. per-token acceptance alpha with E[accepted] + 1 = tau."""
    if not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"--tau {tau} must be in [1, gamma + 1 = {gamma + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E[accepted] = alpha + ... + alpha^Γ grows with alpha: bisect
        alpha = (lo + hi) / 2
        lo, hi = (alpha, hi) if sum(alpha ** i for i in range(1, gamma + 1)) < tau - 1 else (lo, alpha)
    probs = [alpha ** n * (1 - alpha) for n in range(gamma)] + [alpha ** gamma]
    return torch.tensor(probs), alpha


class StatedAcceptor:
    """The verdict's accepted count is a draw from `probs` (P(accepted = n), n = 0..Γ); the next token is the
    target's argmax after the accepted drafts, as greedy acceptance would commit it."""

    def __init__(self, probs: torch.Tensor, seed: int = 0, use_kernel: bool = True) -> None:
        self.probs, self.use_kernel = probs, use_kernel
        self.generator = torch.Generator(device=probs.device).manual_seed(seed)

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, progress: Progress,
               sampling: SlotSampling) -> Verdict:
        rows = proposal.tokens.shape[0]
        accepted = torch.multinomial(self.probs.expand(rows, -1), 1, generator=self.generator)[:, 0]
        target_ids = argmax_last(target_logits, use_kernel=self.use_kernel)  # [B, Γ+1]
        return Verdict(accepted, target_ids.gather(1, accepted[:, None])[:, 0])
