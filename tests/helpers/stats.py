"""Statistical checks the sampling and acceptance tests share."""

from __future__ import annotations

import math

import torch

__all__ = ["chi_square_p_value"]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation, fine for dof >= 3)."""
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
