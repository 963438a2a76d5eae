"""Capture a fixed-shape step once and replay it: the decode step's launch overhead disappears.

The captured function must read only tensors whose storage outlives the graph (the static inputs
given here, the KV cache, the metadata tensors) and must not sync with the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CapturedStep"]


class CapturedStep:
    """`fn(*static_inputs) -> Tensor`, captured in a CUDA graph on first use and replayed afterwards."""

    def __init__(self, fn: Callable[..., torch.Tensor], *static_inputs: torch.Tensor, warmup: int = 2) -> None:
        if not all(t.is_cuda for t in static_inputs):
            raise ValueError("CUDA graphs need CUDA tensors; run eagerly on the CPU")
        self.static_inputs = static_inputs
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lets lazy initialisation (cuBLAS handles, Triton JIT) happen outside capture
                fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = fn(*static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Copy `inputs` into the static buffers and replay; the result aliases the static output."""
        for static, new in zip(self.static_inputs, inputs, strict=True):
            if new.data_ptr() != static.data_ptr():
                static.copy_(new)
        self.graph.replay()
        return self.static_output
