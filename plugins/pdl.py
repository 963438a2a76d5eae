"""Programmatic dependent launch (PDL, Hopper and later) for the project's Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
finishing; its programs then block in `gdc_wait` until that kernel has completed and its writes
are visible. Every kernel here that takes `USE_GDC` calls `gdc_wait` before its first global
memory access, so it reads nothing early and is correct after any predecessor (a cuBLAS GEMM, a
torch op, another of ours). What overlaps is the launch and program set-up, and, when the
predecessor is one of ours, its store epilogue: the full verify and the fused elementwise kernels
call `gdc_launch_dependents` once their main loop is done (the elementwise ones right after the
wait), which lets the next PDL launch be scheduled (it still waits in `gdc_wait` for the whole
grid to complete). The sparse verify kernel signals only by exiting, which measured faster on the
H200 than the early signal (benchmarks/dev/README.md). Inside a CUDA graph the launch attribute
becomes a programmatic edge.

The ops take `pdl=` (the callers pass `KernelConfig.pdl`); a launch uses PDL when that is true and
`pdl_supported(device)`: never on the CPU (interpreter), before sm_90, or on a Triton without the
launch option.
"""

import functools

import torch
import triton
import triton.language as tl

__all__ = ["gdc_args", "gdc_launch_if", "gdc_wait_if", "launch_kwargs", "pdl_supported", "triton_supports_pdl"]


@functools.cache
def triton_supports_pdl() -> bool:
    """Whether this Triton has the grid-dependency ops and the `launch_pdl` launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether launches on `device` can use PDL: a CUDA device of sm_90 or later and a Triton that has it."""
    if device.type != "cuda" or not triton_supports_pdl():
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(use_gdc: bool) -> dict:
    """Extra kernel-launch keywords: `launch_pdl` only when PDL is on (older Tritons lack the option)."""
    return {"launch_pdl": True} if use_gdc else {}


def gdc_args(use_gdc: bool) -> dict:
    """What a launch of a kernel taking USE_GDC passes: the constexpr and, when on, the launch option."""
    return {"USE_GDC": use_gdc, **launch_kwargs(use_gdc)}


@triton.jit
def gdc_wait_if(USE_GDC: tl.constexpr):
    """Block until the previous kernel in the stream has completed (PDL launches only)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_if(USE_GDC: tl.constexpr):
    """Let the next PDL launch in the stream be scheduled (it still waits for this grid to complete)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
