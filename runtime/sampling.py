"""Token sampling: greedy, temperature and nucleus (top-p), batched, seeded, without host syncs.

`SamplingParams` is one request's choice. `SlotSampling` is what a round samples with: every batch slot's
parameters as tensors, and its randomness, either one generator for the whole batch (`generate()`) or one per
slot (in-flight serving, where a request's draws must not depend on what else shares the batch). Both modes run
the same per-row arithmetic, so a slot of a batch samples exactly what a one-slot batch with its generator does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trtllm_dustin.plugins.argmax import argmax_last

__all__ = ["SamplingParams", "SlotSampling", "sampling_probs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1 keeps the whole distribution
    seed: int = 0  # seeds the sampling generator of a generate() call

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [..., V] restricted to each row's top-p nucleus (top_p broadcast against [..., 1]), renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's distribution: softmax(logits / T) restricted to the top-p nucleus, renormalised. [.., V]
    The readable reference of SlotSampling.probs, which computes the same per row."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, torch.tensor(params.top_p, device=probs.device))
    return probs


class SlotSampling:
    """Every batch slot's sampling for a run of rounds: parameters on the device, randomness per slot or shared.

    params[b] is slot b's SamplingParams (None: an idle slot, treated as greedy). generators: one generator for
    every slot (shared mode, `generate()`), or one per slot (None for greedy and idle slots). Rows are sampled with
    per-row temperature and top-p tensors whichever the mode; random draws cover every row in shared mode and only
    the sampled slots' rows, each from its own generator, in per-slot mode.
    """

    def __init__(self, params: Sequence[SamplingParams | None], generators: torch.Generator | Sequence[
            torch.Generator | None], device: torch.device, use_kernel: bool = True) -> None:
        self.params = list(params)
        self.device, self.use_kernel = device, use_kernel
        self.shared = isinstance(generators, torch.Generator)
        self.generators = generators if self.shared else list(generators)
        if not self.shared and len(self.generators) != len(self.params):
            raise ValueError(f"{len(self.generators)} generators for {len(self.params)} slots; give one per slot")
        self.sampled = [p is not None and not p.greedy for p in self.params]
        self.all_greedy = not any(self.sampled)
        self.any_greedy = not all(self.sampled)
        if not self.shared:
            missing = [b for b, s in enumerate(self.sampled) if s and self.generators[b] is None]
            if missing:
                raise ValueError(f"sampled slots {missing} have no generator")
        # Greedy rows get T = 1 so that their (unused) probabilities stay finite.
        self.temperature = torch.tensor([p.temperature if s else 1.0 for p, s in zip(self.params, self.sampled,
                                                                                     strict=True)],
                                        dtype=torch.float32, device=device)
        self.top_p = torch.tensor([p.top_p if p is not None else 1.0 for p in self.params], dtype=torch.float32,
                                  device=device)
        self.greedy_rows = torch.tensor([not s for s in self.sampled], dtype=torch.bool, device=device)
        self._nucleus = any(p is not None and s and p.top_p < 1.0 for p, s in zip(self.params, self.sampled,
                                                                                  strict=True))

    @classmethod
    def batch(cls, params: SamplingParams, slots: int, device: torch.device, seed: int | None = None,
              use_kernel: bool = True) -> SlotSampling:
        """Every slot with `params` and one generator seeded with `seed` (default params.seed)."""
        generator = torch.Generator(device=device).manual_seed(params.seed if seed is None else seed)
        return cls([params] * slots, generator, device, use_kernel)

    @staticmethod
    def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A per-slot [B] tensor shaped to broadcast against like [B, ..., V]."""
        return values.view(-1, *([1] * (like.dim() - 1)))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution over logits [B, ..., V] (greedy rows: softmax at T = 1, unused)."""
        probs = torch.softmax(logits.float() / self._per_row(self.temperature, logits), dim=-1)
        if self._nucleus:
            probs = _nucleus(probs, self._per_row(self.top_p, logits))
        return probs

    def _draw(self, shape: tuple[int, ...], fill: float, draw) -> torch.Tensor:
        """Random values of `shape` [B, ...]: shared mode draws every row at once, per-slot mode row by row from
        each sampled slot's generator (other rows hold `fill`)."""
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        if out.numel() == 0:
            return out
        if self.shared:
            return draw(out, self.generators)
        out.fill_(fill)
        for b, sampled in enumerate(self.sampled):
            if sampled:
                draw(out[b], self.generators[b])
        return out

    def exponential(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self._draw(shape, 1.0, lambda t, g: t.exponential_(generator=g))

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self._draw(shape, 0.5, lambda t, g: t.uniform_(generator=g))

    def pick(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of logits [B, V]: greedy rows by argmax, sampled rows from `probs` (default
        self.probs(logits)) by an exponential race (argmax p_i / E_i, E_i ~ Exp(1), picks i with probability p_i)."""
        if self.all_greedy:
            return argmax_last(logits, use_kernel=self.use_kernel)
        probs = self.probs(logits) if probs is None else probs
        drawn = (probs / self.exponential(tuple(probs.shape))).argmax(dim=-1)
        if not self.any_greedy:
            return drawn
        return torch.where(self.greedy_rows, argmax_last(logits, use_kernel=self.use_kernel), drawn)
