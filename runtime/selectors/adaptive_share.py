"""An input-aware draft share for Dustin-H (beyond the paper; evaluation only: dustin-h-adaptive).

The searched m is one number for every input; but the lookahead is worth its slots only for the drafted tokens
that will be accepted, and how many that is varies round by round with the draft's certainty (low in free prose,
high in copying and code), which the draft's own probabilities measure at no extra cost. On the H200 quality run
(benchmarks/results/quality/quality_h200.md) it lost to the searched fixed m on books KL and needle retrieval at
every budget and context, so it is not offered as a user option.
"""

from __future__ import annotations

import torch

__all__ = ["AdaptiveShare", "adaptive_m"]


def adaptive_m(draft_confidence: torch.Tensor, free: int) -> torch.Tensor:
    """Input-aware draft share: m_b = round(free * E[a_b] / (1 + E[a_b])) -> int64 [B].

    draft_confidence [B, Γ]: the draft's probability of each drafted token (greedy: its max probability), taken as
    the chance the target accepts it, so E[a] = sum_i prod_{j<=i} p_j is the expected accepted length. Only the
    queries up to the first rejection decide a round (positions L .. L + a, Eq. 2's window cut at the rejection);
    the first of them is the committed token, which the target's own history describes best, the other a are
    drafted tokens that only the draft's lookahead sees. So the lookahead gets their expected share E[a] / (1 + E[a])
    of the free slots: all history (Dustin-T) when the draft is guessing, up to Γ / (Γ + 1) when it is sure.
    """
    expected = torch.cumprod(draft_confidence.float(), dim=1).sum(dim=1)
    return torch.round(free * expected / (1 + expected)).long()


class AdaptiveShare:
    """m per slot and round from the draft's confidence (the Lookahead's `confidence`, asked for at build)."""

    def __init__(self, confidence: torch.Tensor, free: int) -> None:
        self.confidence, self.free = confidence, free
        self.m = torch.zeros(confidence.shape[0], dtype=torch.long, device=confidence.device)

    def __call__(self) -> torch.Tensor:
        self.m.copy_(adaptive_m(self.confidence, self.free))
        return self.m
