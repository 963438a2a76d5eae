"""Capture a fixed-shape step once and replay it: the step's launch overhead disappears.

A captured function must read only tensors whose storage outlives the graph (the static inputs given here, the
KV caches, the round state, a component's own buffers) and must not sync with the host. `PhaseGraphs` holds a
decoder's phases by name and records the KernelConfig they were captured with: a graph replays the kernels (and
launch options) chosen at capture, whatever the models are set to later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trtllm_dustin.plugins.kernel_config import KernelConfig

__all__ = ["CapturedStep", "PhaseGraphs"]


class CapturedStep:
    """`fn(*static_inputs)`, captured in a CUDA graph on first use and replayed afterwards."""

    def __init__(self, fn: Callable[..., Any], *static_inputs: torch.Tensor, warmup: int = 2,
                 restore: tuple[torch.Tensor, ...] = ()) -> None:
        """restore: buffers `fn` rewrites in place that its next run must start from unchanged (an in-pass set):
        put back after each warm-up run, so that the first replay starts from what the caller left there."""
        if not all(t.is_cuda for t in static_inputs):
            raise ValueError("CUDA graphs need CUDA tensors; run eagerly on the CPU")
        self.static_inputs = static_inputs
        saved = [t.clone() for t in restore]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lets lazy initialisation (cuBLAS handles, Triton JIT) happen outside capture
                fn(*static_inputs)
                for t, before in zip(restore, saved, strict=True):
                    t.copy_(before)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = fn(*static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Copy `inputs` into the static buffers and replay; the result aliases the static output."""
        for static, new in zip(self.static_inputs, inputs, strict=True):
            if new.data_ptr() != static.data_ptr():
                static.copy_(new)
        self.graph.replay()
        return self.static_output


class PhaseGraphs:
    """A decoder's fixed-shape phases by name: run eagerly, or captured on first use and replayed (enabled)."""

    def __init__(self, enabled: bool, kernels: KernelConfig) -> None:
        self.enabled = enabled
        self.kernels = kernels  # what every graph here was captured with
        self._steps: dict[str, CapturedStep] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        if not self.enabled:
            return fn()
        if name not in self._steps:
            self._steps[name] = CapturedStep(fn)
        return self._steps[name]()
