"""What a round reads and writes besides the caches: the per-slot token state and a run's progress.

State between rounds, per batch slot b: the target cache holds the committed tokens [0, L_b); `cur` (the last
committed token, at position L_b) is in neither cache yet; `prev` is the token at L_b - 1. Rejected cache positions
are simply overwritten by later rounds. Idle slots run along at L_b = 1 so that every round keeps one shape (a
model drafter's first step reads position L_b - 1); their writes land where nothing reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["IDLE_LENGTH", "Observation", "Progress", "RoundState"]

IDLE_LENGTH = 1


@dataclass
class RoundState:
    """The tokens the captured phases read, one row per batch slot: allocated once, updated in place (their
    storage is what the CUDA graphs recorded)."""

    lengths: torch.Tensor  # int32 [B]: committed tokens L_b; the same storage as the target cache's seqlens
    cur: torch.Tensor  # int64 [B]: the last committed token, at position L_b
    prev: torch.Tensor  # int64 [B]: the token at L_b - 1

    @classmethod
    def allocate(cls, lengths: torch.Tensor) -> RoundState:
        slots, device = lengths.shape[0], lengths.device
        return cls(lengths, torch.zeros(slots, dtype=torch.long, device=device),
                   torch.zeros(slots, dtype=torch.long, device=device))

    def idle(self, slots: slice) -> None:
        """Put the slots [start, stop) at the idle position."""
        self.lengths[slots] = IDLE_LENGTH
        self.cur[slots] = 0
        self.prev[slots] = 0


@dataclass
class Progress:
    """What a run has generated so far, on the device; the commit updates it in place."""

    out: torch.Tensor  # int64 [B, W + 1]: generated ids (-1 = none); the last column takes masked writes
    active: torch.Tensor  # bool [B]: still generating
    generated: torch.Tensor  # int64 [B]: tokens generated so far (the first one, from prefill, included)
    limits: torch.Tensor  # int64 [B]: each slot's max_new_tokens (<= W)
    hist: torch.Tensor  # int64 [Γ + 1]: sequence-rounds by accepted draft count
    eos: torch.Tensor  # int64 [E >= 1]: ids that end a sequence ([-1] for none)

    @classmethod
    def allocate(cls, slots: int, width: int, gamma: int, eos_token_ids: Sequence[int], device: torch.device
                 ) -> Progress:
        return cls(out=torch.full((slots, width + 1), -1, dtype=torch.long, device=device),
                   active=torch.zeros(slots, dtype=torch.bool, device=device),
                   generated=torch.zeros(slots, dtype=torch.long, device=device),
                   limits=torch.zeros(slots, dtype=torch.long, device=device),
                   hist=torch.zeros(gamma + 1, dtype=torch.long, device=device),
                   eos=torch.tensor(tuple(eos_token_ids) or (-1,), dtype=torch.long, device=device))

    @property
    def width(self) -> int:
        return self.out.shape[1] - 1

    def begin(self, slots: slice, first: torch.Tensor, limits: int | Sequence[int]) -> None:
        """Slots start a sequence whose first generated token (from the prefill logits) is `first` [n]."""
        n = first.shape[0]
        limits = [limits] * n if isinstance(limits, int) else list(limits)
        if len(limits) != n or max(limits) > self.width:
            raise ValueError(f"token limits {limits} must be {n} values <= this run's width {self.width}")
        limit = torch.tensor(limits, dtype=torch.long, device=first.device)
        self.out[slots] = -1
        self.out[slots, 0] = first
        self.generated[slots] = 1
        self.limits[slots] = limit
        self.active[slots] = ~torch.isin(first, self.eos) & (limit > 1)

    def tokens(self, rows: int) -> list[list[int]]:
        """The generated ids of slots 0 .. rows - 1 (one host sync)."""
        return [[t for t in row if t >= 0] for row in self.out[:rows, : self.width].tolist()]


@dataclass
class Observation:
    """What one round decided, handed to the drafter and the selector before the commit moves the state on."""

    accepted: torch.Tensor  # int64 [B]: draft tokens accepted, 0 .. Γ
    next_tokens: torch.Tensor  # int64 [B]: the target's token after them
    active: torch.Tensor  # bool [B]: the slots that took part (the commit has not yet turned any off)
    lengths: torch.Tensor  # int32 [B]: L_b before the commit
    indices: torch.Tensor | None  # int32 [B, k]: the round's verification set (None: full verification)
    verify_queries: dict[int, torch.Tensor]  # target layer -> [B, Γ + 1, H_q, D] queries of the verified tokens
    verify_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # target layer -> [B, Γ + 1, H] hidden
