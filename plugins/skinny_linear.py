"""Skinny-M linear layer: y = x @ W^T (+ b) for the few token rows of a decode, draft or verify step.

At decode batch sizes (M = B * T = 16-64 rows) a projection reads its whole weight matrix to produce a few
rows, so it is a weight-streaming kernel: its time is weight bytes / bandwidth plus how unevenly the work
lands on the 132 SMs. cuBLAS picks wide tiles there (e.g. 256 output columns for Llama-8B's gate/up, 112
programs for 132 SMs), which leaves SMs idle for the whole kernel.

This kernel tiles the output columns in BLOCK_N and optionally splits K into SPLIT_K slices so that the
grid covers every SM several times. With SWAP the tile product is computed as W_tile @ x_tile^T (BLOCK_N
rows in the MMA's M slot, where Hopper's wgmma wants 64), else x_tile @ W_tile^T.

Split-K reduction without a second launch: each program stores its fp32 partial tile into `partials`
[SPLIT_K, M, N], then bumps the tile's counter; the program that arrives last sums the SPLIT_K partials in
slice order (deterministic), adds the bias, writes y, and resets the counter to 0 for the next call (so the
launch is replayable in a CUDA graph with the same buffers).

Launch contract (`skinny_linear_forward`): x [M, K] with unit stride along K, W [N, K] contiguous, bias [N]
or None, all one dtype (bf16 / fp16 / fp32); y [M, N] in that dtype. Grid (cdiv(N, BLOCK_N), SPLIT_K).
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_enabled
from .split_kv import dot_mode, runs_triton, tile_dot

__all__ = ["MAX_ROWS", "TUNED", "LinearConfig", "SplitKWorkspace", "pick_config", "skinny_linear",
           "skinny_linear_forward", "skinny_linear_ref"]

MAX_ROWS = 64  # more rows than this (prefill chunks) are a regular GEMM: F.linear


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration of the skinny linear kernel."""

    block_n: int = 64  # output columns per program
    block_k: int = 128  # K elements per loop step
    split_k: int = 1  # programs per output tile, each summing a contiguous slice of K
    swap: bool = True  # W_tile @ x^T (BLOCK_N in the MMA's M slot) instead of x @ W_tile^T
    num_warps: int = 4
    num_stages: int = 4
    prefetch_k: int = 512  # with PDL: weight columns per row pulled into L2 before waiting on the previous kernel

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name}={value} must be a power of two >= 16")
        if self.prefetch_k and (self.prefetch_k < 64 or self.prefetch_k & (self.prefetch_k - 1)):
            raise ValueError(f"LinearConfig.prefetch_k={self.prefetch_k} must be 0 or a power of two >= 64")
        if self.split_k < 1:
            raise ValueError(f"LinearConfig.split_k={self.split_k} must be >= 1")


@dataclass
class SplitKWorkspace:
    """Buffers of a split-K launch: fp32 partial tiles and one arrival counter per output tile (kept at 0)."""

    partials: torch.Tensor  # fp32 [>= split_k * M * N]
    counters: torch.Tensor  # int32 [>= output tiles], all 0 between launches

    @classmethod
    def allocate(cls, m: int, n: int, config: LinearConfig, device: torch.device) -> "SplitKWorkspace":
        return cls(torch.empty(config.split_k * m * n, dtype=torch.float32, device=device),
                   torch.zeros(triton.cdiv(n, config.block_n), dtype=torch.int32, device=device))

    def fits(self, m: int, n: int, config: LinearConfig) -> bool:
        return (self.partials.numel() >= config.split_k * m * n
                and self.counters.numel() >= triton.cdiv(n, config.block_n))


def _tuned(block_n: int, block_k: int, swap: bool, num_warps: int, num_stages: int) -> LinearConfig:
    return LinearConfig(block_n=block_n, block_k=block_k, swap=swap, num_warps=num_warps, num_stages=num_stages)


# Fastest single-slice configurations of the H200 sweep (benchmarks/bench_linear.py, linear_h200.json), keyed by
# (rows rounded up to 16 / 32 / 64, N, K): Llama-3.1-8B's verify (64 rows) and Llama-3.2-1B's draft steps.
TUNED: dict[tuple[int, int, int], LinearConfig] = {
    (64, 6144, 4096): _tuned(64, 128, False, 4, 6),
    (64, 4096, 4096): _tuned(32, 128, False, 4, 6),
    (64, 28672, 4096): _tuned(128, 128, True, 8, 4),
    (64, 4096, 14336): _tuned(32, 256, False, 4, 4),
    (64, 128256, 4096): _tuned(128, 128, True, 8, 4),
    (16, 3072, 2048): _tuned(64, 256, True, 4, 4),
    (16, 2048, 2048): _tuned(64, 256, True, 4, 4),
    (16, 16384, 2048): _tuned(64, 128, True, 4, 4),
    (16, 2048, 8192): _tuned(32, 128, True, 4, 4),
    (16, 128256, 2048): _tuned(128, 128, True, 4, 3),
    (32, 3072, 2048): _tuned(64, 256, True, 4, 4),
    (32, 2048, 2048): _tuned(64, 256, True, 4, 4),
    (32, 16384, 2048): _tuned(64, 128, True, 4, 3),
    (32, 2048, 8192): _tuned(32, 128, True, 4, 4),
}


def pick_config(m: int, n: int, k: int) -> LinearConfig:
    """The tuned configuration for the shape, else 64-column tiles (32 when that leaves fewer than 2 waves)."""
    block_m = max(16, triton.next_power_of_2(m))
    if (block_m, n, k) in TUNED:
        return TUNED[(block_m, n, k)]
    block_n = 64 if triton.cdiv(n, 64) >= 2 * 132 else 32
    return LinearConfig(block_n=block_n, block_k=128, swap=True, num_warps=4, num_stages=4)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          split_k, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                          EVEN_K: tl.constexpr, DOT_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr,
                          PREFETCH_K: tl.constexpr = 0, USE_GDC: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_tiles)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if PREFETCH_K > 0:
        # The weights do not depend on the previous kernel: pull the first PREFETCH_K columns of this program's
        # rows into L2 while that kernel finishes (PDL), so the stream is at full rate when the wait returns.
        lines = first * BLOCK_K + tl.arange(0, PREFETCH_K // 64) * 64  # one 128-byte line per 64 bf16
        _prefetch_l2(w_rows + tl.minimum(lines, K - 1)[None, :])
    gdc_wait_if(USE_GDC)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        k = t * BLOCK_K + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k[None, :] < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        if SWAP:
            acc += tile_dot(w, tl.trans(x), DOT_MODE)
        else:
            acc += tile_dot(x, tl.trans(w), DOT_MODE)
    gdc_launch_if(USE_GDC)  # the next kernel may be scheduled (it still waits for this grid to finish)
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    y_tile = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=tile_ok)
    else:
        part_tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part_tile, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the last slice to arrive sums all of them, in slice order
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(split_k):
                total += tl.load(part_ptr + s * M * N + part_tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_tile, total.to(y_ptr.dtype.element_ty), mask=tile_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def skinny_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: LinearConfig,
                          workspace: SplitKWorkspace | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias with the Triton kernel; x [..., K] (rows flattened), weight [N, K]."""
    *lead, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dim {K}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype; got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous [N, K]")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > 128:
        raise ValueError(f"skinny_linear takes at most 128 rows (got M={M}); larger M is a regular GEMM")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if config.split_k > 1:
        if workspace is None:
            workspace = SplitKWorkspace.allocate(M, N, config, x.device)
        elif not workspace.fits(M, N, config):
            raise ValueError(f"workspace too small for M={M}, N={N}, {config}")
        part, counters = workspace.partials, workspace.counters
    else:
        part, counters = y, y  # unused
    block_m = max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, config.block_n), config.split_k)
    use_gdc = pdl_enabled(x.device)
    # prefetch only pays (and inline PTX only runs) on a PDL launch on the GPU
    prefetch = config.prefetch_k if use_gdc and weight.element_size() == 2 else 0
    _skinny_linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, part, counters, M, N, K, x2.stride(0), weight.stride(0),
        y.stride(0), config.split_k, HAS_BIAS=bias is not None, SPLIT=config.split_k > 1, SWAP=config.swap,
        EVEN_K=K % config.block_k == 0, DOT_MODE=dot_mode(x.dtype), BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PREFETCH_K=prefetch, num_warps=config.num_warps, num_stages=config.num_stages, **gdc_args(use_gdc))
    return y.view(*lead, N)


@torch.library.custom_op("trtllm_dustin::skinny_linear", mutates_args=())
def _skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    if not runs_triton(x) or M == 0 or M > MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16):
        return skinny_linear_ref(x, weight, bias)
    return skinny_linear_forward(x, weight, bias, pick_config(M, N, K))


@_skinny_linear_op.register_fake
def _(x, weight, bias) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized inputs: x [..., K] with at most MAX_ROWS rows in bf16 / fp16 runs the
    Triton kernel (PDL launch with an L2 weight prefetch on sm_90+); anything else, and TRTLLM_DUSTIN_SKINNY_LINEAR=0,
    runs F.linear."""
    if os.environ.get("TRTLLM_DUSTIN_SKINNY_LINEAR", "1") == "0":
        return F.linear(x, weight, bias)
    return _skinny_linear_op(x, weight, bias)
