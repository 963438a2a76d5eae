"""Sampling follows the distribution it claims (chi-square), greedy is argmax, top-p keeps the nucleus."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_dustin.runtime.sampling import SamplingParams, sample, sampling_probs


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation, fine for dof >= 3)."""
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_samples_follow_the_distribution(temperature: float, top_p: float) -> None:
    torch.manual_seed(0)
    V, N = 11, 40000
    logits = torch.randn(V) * 1.5
    params = SamplingParams(temperature, top_p, seed=1)
    probs = sampling_probs(logits, params)
    gen = torch.Generator().manual_seed(1)
    draws = sample(logits.expand(N, V), params, gen)
    counts = torch.bincount(draws, minlength=V).double()
    assert counts[probs == 0].sum() == 0  # nothing outside the nucleus
    assert chi_square_p_value(counts, probs.double()) > 1e-3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = sampling_probs(logits, SamplingParams(1.0, 0.75))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = sampling_probs(logits, SamplingParams(1.0, 0.1))  # the top token always stays
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_greedy_is_argmax_and_seeded_sampling_repeats() -> None:
    logits = torch.randn(7, 50)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    p = SamplingParams(1.0, 0.9, seed=5)
    a = sample(logits, p, torch.Generator().manual_seed(5))
    b = sample(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_invalid_params() -> None:
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
