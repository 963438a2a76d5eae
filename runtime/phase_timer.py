"""Per-phase timing of a decode round: CUDA events on the GPU, wall clock on the CPU, nothing when off.

Events are only read at the end of a run (`totals_ms`), so timing adds no host sync inside a round.
It is still kept to a separate profiling pass: events between graph replays can delay launches.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PHASES", "PhaseTimer"]

PHASES = ("draft", "estimate", "select", "verify", "accept")


class PhaseTimer:
    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[phase].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[phase] += time.perf_counter() - t0

    def totals_ms(self) -> dict[str, float]:
        """Total milliseconds spent in each phase (synchronises once)."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
        totals = {p: s * 1e3 for p, s in self._seconds.items()}
        for phase, pairs in self._events.items():
            totals[phase] = totals.get(phase, 0.0) + sum(a.elapsed_time(b) for a, b in pairs)
        return totals
