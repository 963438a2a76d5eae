"""Skinny-M linear layer: y = x @ W^T (+ b) for the few token rows of a decode, draft or verify step.

At decode batch sizes (M = B * T = 16-64 rows) a projection reads its whole weight matrix to produce a few
rows, so it is a weight-streaming kernel: its time is weight bytes / bandwidth plus how unevenly the work
lands on the 132 SMs. cuBLAS picks wide tiles there (its kernel for Llama-8B's 64-row gate/up has 256 x 64
tiles: 112 of them for 132 SMs), which leaves SMs idle for the whole kernel.

This kernel tiles the output columns in BLOCK_N and optionally splits K into SPLIT_K slices so that the
grid covers every SM several times. With SWAP the tile product is computed as W_tile @ x_tile^T (BLOCK_N
rows in the MMA's M slot, where Hopper's wgmma wants 64), else x_tile @ W_tile^T. Measured on the H200
(benchmarks/bench_linear.py): the best configuration per shape is 0-16 % faster than cuBLAS alone, most on
small matrices and on the output heads; TUNED holds those, and leaves cuBLAS where it was as fast. The decoder
launches it with PDL: each program waits for the previous kernel before its first read and lets the next launch
be scheduled once its main loop is done. That took a Dustin-H round at Llama-8B + 1B, B = 16, 32K from 20.71 to
20.50 ms and left vanilla at 19.3 ms (two interleaved pairs, git d12c6e3), the same with or without PDL on the
projection after attention (git 95f45e6). An earlier variant that also prefetched the first weight columns into
L2 before the wait measured 1.7 ms slower per vanilla step and was removed.

Split-K reduction without a second launch: each program stores its fp32 partial tile into `partials`
[SPLIT_K, M, N], then bumps the tile's counter; the program that arrives last sums the SPLIT_K partials in
slice order (deterministic), adds the bias, writes y, and resets the counter to 0 for the next call (so the
launch is replayable in a CUDA graph with the same buffers).

Launch contract (`skinny_linear_forward`): x [M, K] with unit stride along K, W [N, K] contiguous, bias [N]
or None, all one dtype (bf16 / fp16 / fp32); y [M, N] in that dtype; with SPLIT_K > 1 a SplitKWorkspace
(fp32 partials of >= SPLIT_K * M * N, int32 counters of >= cdiv(N, BLOCK_N), zero). Grid (cdiv(N, BLOCK_N),
SPLIT_K). One workspace may serve every launch of a stream: a launch resets its counters before it ends.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_enabled
from .split_kv import dot_mode, runs_triton, tile_dot
from .switches import switched_on

__all__ = ["MAX_ROWS", "TUNED", "LinearConfig", "SplitKWorkspace", "pick_config", "row_block", "skinny_linear",
           "skinny_linear_forward", "skinny_linear_ref"]

MAX_ROWS = 64  # more rows than this (prefill chunks) are a regular GEMM: F.linear
_DTYPES = (torch.bfloat16, torch.float16)  # what the op runs on the kernel (fp32: F.linear)


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration of the skinny linear kernel."""

    block_n: int = 64  # output columns per program
    block_k: int = 128  # K elements per loop step
    split_k: int = 1  # programs per output tile, each summing a contiguous slice of K
    swap: bool = True  # W_tile @ x^T (BLOCK_N in the MMA's M slot) instead of x @ W_tile^T
    num_warps: int = 4
    num_stages: int = 4
    tie: bool = False  # within 1 % of cuBLAS in the plain-launch sweep: taken only for PDL launches

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name}={value} must be a power of two >= 16")
        if self.split_k < 1:
            raise ValueError(f"LinearConfig.split_k={self.split_k} must be >= 1")


@dataclass
class SplitKWorkspace:
    """Buffers of split-K launches: fp32 partial tiles and one arrival counter per output tile (kept at 0). One
    workspace serves every launch of a stream: each launch resets its counters before it completes."""

    partials: torch.Tensor  # fp32 [>= split_k * M * N]
    counters: torch.Tensor  # int32 [>= output tiles], all 0 between launches

    @classmethod
    def for_outputs(cls, max_n: int, device: torch.device, max_split: int = 8) -> "SplitKWorkspace":
        """Room for any launch of at most MAX_ROWS rows, max_n columns, max_split slices and 16-column tiles."""
        return cls(torch.empty(max_split * MAX_ROWS * max_n, dtype=torch.float32, device=device),
                   torch.zeros(triton.cdiv(max_n, 16), dtype=torch.int32, device=device))

    @classmethod
    def allocate(cls, m: int, n: int, config: LinearConfig, device: torch.device) -> "SplitKWorkspace":
        return cls(torch.empty(config.split_k * m * n, dtype=torch.float32, device=device),
                   torch.zeros(triton.cdiv(n, config.block_n), dtype=torch.int32, device=device))

    def fits(self, m: int, n: int, config: LinearConfig) -> bool:
        return (self.partials.numel() >= config.split_k * m * n
                and self.counters.numel() >= triton.cdiv(n, config.block_n))


def _tuned(block_n: int, block_k: int, swap: bool, num_warps: int, num_stages: int, split_k: int = 1) -> LinearConfig:
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k, swap=swap, num_warps=num_warps,
                        num_stages=num_stages)


def _tie(*args, **kwargs) -> LinearConfig:
    return replace(_tuned(*args, **kwargs), tie=True)


# The fastest configuration per shape of the H200 sweeps of benchmarks/bench_linear.py (plain launches, git 2a7352b
# and 8182bae; benchmarks/results/linear*_h200.json), keyed by (rows rounded up to 16 / 32 / 64, N, K), for the
# e2e pairs' verify (B * (Γ + 1) rows), draft (B and 2B rows) and vanilla (B rows) projections at B = 8 and 16;
# None where the kernel was not at least 2 % faster than cuBLAS, except a tie (_tie: within 1 %), which a PDL launch
# takes: PDL hides about 1.6 us of each launch inside a graph (a Dustin-H round at Llama-8B + 1B, B = 16, 32K: 132
# PDL launches, 0.21 ms faster), which cuBLAS cannot do. Shapes not listed run F.linear.
TUNED: dict[tuple[int, int, int], LinearConfig | None] = {
    # llama-8b B16
    (64, 6144, 4096): _tie(64, 128, False, 4, 6),  # target.qkv, 64 rows: cuBLAS 16.3 us, ours 16.2 (a tie)
    (64, 4096, 4096): _tie(32, 128, False, 4, 6),  # target.o, 64 rows: cuBLAS 11.9 us, ours 11.9 (a tie)
    (64, 28672, 4096): _tuned(128, 128, False, 8, 4),  # target.gate_up, 64 rows: 62.2 -> 60.1 us
    (64, 4096, 14336): _tuned(32, 256, False, 4, 4),  # target.down, 64 rows: 36.5 -> 33.5 us
    (64, 128256, 4096): _tuned(128, 64, False, 8, 4),  # target.lm_head, 64 rows: 284.6 -> 264.5 us
    (16, 6144, 4096): _tuned(64, 256, True, 4, 4),  # target.qkv, 16 rows: 16.8 -> 15.0 us
    (16, 4096, 4096): _tuned(64, 256, True, 4, 4),  # target.o, 16 rows: 13.5 -> 11.4 us
    (16, 28672, 4096): _tie(64, 128, True, 4, 4),  # target.gate_up, 16 rows: cuBLAS 57.1 us, ours 56.8 (a tie)
    (16, 4096, 14336): _tuned(32, 256, True, 4, 6),  # target.down, 16 rows: 33.0 -> 31.2 us
    (16, 128256, 4096): _tuned(128, 128, True, 4, 3),  # target.lm_head, 16 rows: 253.7 -> 240.9 us
    (16, 3072, 2048): _tie(64, 256, True, 4, 4),  # draft.qkv, 16 rows: cuBLAS 6.6 us, ours 6.6 (a tie)
    (16, 2048, 2048): _tie(64, 256, True, 4, 4),  # draft.o, 16 rows: cuBLAS 6.3 us, ours 6.2 (a tie)
    (16, 16384, 2048): _tie(64, 128, True, 4, 3),  # draft.gate_up, 16 rows: cuBLAS 18.7 us, ours 18.3 (a tie)
    (16, 2048, 8192): _tuned(32, 128, True, 4, 4, split_k=4),  # draft.down, 16 rows: 13.9 -> 12.5 us
    (16, 128256, 2048): _tuned(128, 128, True, 4, 3),  # draft.lm_head, 16 rows: 130.8 -> 123.0 us
    (32, 3072, 2048): None,  # draft.qkv, 32 rows: cuBLAS 6.6 us, ours 6.9
    (32, 2048, 2048): None,  # draft.o, 32 rows: cuBLAS 6.2 us, ours 6.7
    (32, 16384, 2048): _tuned(64, 128, True, 4, 3),  # draft.gate_up, 32 rows: 19.2 -> 18.5 us
    (32, 2048, 8192): _tuned(32, 128, True, 4, 4, split_k=4),  # draft.down, 32 rows: 14.1 -> 13.5 us
    # llama-8b B8
    (32, 6144, 4096): _tuned(64, 128, True, 4, 6),  # target.qkv, 32 rows: 15.9 -> 15.4 us
    (32, 4096, 4096): _tuned(64, 128, True, 4, 6),  # target.o, 32 rows: 13.0 -> 11.8 us
    (32, 28672, 4096): _tie(128, 128, True, 4, 4),  # target.gate_up, 32 rows: cuBLAS 58.1 us, ours 58.0 (a tie)
    (32, 4096, 14336): _tie(64, 128, True, 4, 3, split_k=4),  # target.down, 32 rows: cuBLAS 33.2 us, ours 33.2 (a tie)
    (32, 128256, 4096): _tuned(128, 128, False, 4, 3),  # target.lm_head, 32 rows: 267.5 -> 244.8 us
    # qwen-7b B16
    (64, 4608, 3584): None,  # target.qkv, 64 rows: cuBLAS 11.6 us, ours 13.3
    (64, 3584, 3584): None,  # target.o, 64 rows: cuBLAS 9.6 us, ours 10.1
    (64, 37888, 3584): _tuned(128, 64, False, 8, 3),  # target.gate_up, 64 rows: 72.5 -> 70.9 us
    (64, 3584, 18944): None,  # target.down, 64 rows: cuBLAS 39.7 us, ours 41.4
    (64, 152064, 3584): _tuned(128, 128, False, 8, 4),  # target.lm_head, 64 rows: 274.4 -> 266.3 us
    (16, 4608, 3584): _tuned(64, 256, True, 4, 4),  # target.qkv, 16 rows: 12.2 -> 11.3 us
    (16, 3584, 3584): _tuned(64, 256, True, 4, 4),  # target.o, 16 rows: 10.9 -> 9.7 us
    (16, 37888, 3584): _tuned(64, 64, True, 4, 3),  # target.gate_up, 16 rows: 73.3 -> 65.2 us
    (16, 3584, 18944): _tuned(64, 128, True, 4, 4, split_k=3),  # target.down, 16 rows: 39.9 -> 37.3 us
    (16, 152064, 3584): _tuned(128, 128, False, 4, 3),  # target.lm_head, 16 rows: 263.4 -> 248.9 us
    (16, 1152, 896): _tuned(64, 64, True, 4, 6),  # draft.qkv, 16 rows: 4.8 -> 4.6 us
    (16, 896, 896): _tuned(64, 64, True, 4, 6),  # draft.o, 16 rows: 4.1 -> 3.7 us
    (16, 9728, 896): _tuned(128, 128, True, 4, 4),  # draft.gate_up, 16 rows: 7.3 -> 6.9 us
    (16, 896, 4864): _tuned(32, 128, True, 4, 4, split_k=8),  # draft.down, 16 rows: 7.5 -> 7.2 us
    (16, 151936, 896): _tuned(128, 128, False, 4, 3),  # draft.lm_head, 16 rows: 71.2 -> 67.6 us
    (32, 1152, 896): _tuned(64, 128, True, 4, 4),  # draft.qkv, 32 rows: 4.8 -> 4.6 us
    (32, 896, 896): _tie(64, 128, True, 4, 4),  # draft.o, 32 rows: cuBLAS 4.0 us, ours 3.9 (a tie)
    (32, 9728, 896): _tuned(128, 64, True, 4, 6),  # draft.gate_up, 32 rows: 7.3 -> 7.2 us
    (32, 896, 4864): None,  # draft.down, 32 rows: cuBLAS 7.6 us, ours 8.3
    # qwen-7b B8
    (32, 4608, 3584): None,  # target.qkv, 32 rows: cuBLAS 11.2 us, ours 11.4
    (32, 3584, 3584): _tuned(64, 256, True, 4, 4),  # target.o, 32 rows: 11.1 -> 10.0 us
    (32, 37888, 3584): _tuned(64, 128, True, 4, 3),  # target.gate_up, 32 rows: 73.6 -> 67.0 us
    (32, 3584, 18944): _tie(64, 128, True, 4, 4, split_k=3),  # target.down, 32 rows: cuBLAS 39.2 us, ours 38.5 (a tie)
    (32, 152064, 3584): _tuned(128, 128, False, 4, 4),  # target.lm_head, 32 rows: 266.5 -> 257.7 us
    # qwen-14b B8
    (32, 7168, 5120): _tuned(64, 128, True, 4, 6),  # target.qkv, 32 rows: 21.2 -> 20.7 us
    (32, 5120, 5120): _tie(64, 128, True, 4, 6),  # target.o, 32 rows: cuBLAS 16.1 us, ours 16.1 (a tie)
    (32, 27648, 5120): _tie(64, 128, True, 4, 4),  # target.gate_up, 32 rows: cuBLAS 69.7 us, ours 69.6 (a tie)
    (32, 5120, 13824): _tuned(64, 256, True, 4, 4),  # target.down, 32 rows: 40.1 -> 38.5 us
    (32, 152064, 5120): _tuned(128, 128, True, 4, 4),  # target.lm_head, 32 rows: 378.1 -> 360.0 us
    (16, 7168, 5120): _tuned(64, 128, True, 4, 6),  # target.qkv, 8 rows: 22.8 -> 20.4 us
    (16, 5120, 5120): _tie(64, 256, True, 4, 4),  # target.o, 8 rows: cuBLAS 15.7 us, ours 15.4 (a tie)
    (16, 27648, 5120): _tie(64, 128, True, 4, 4),  # target.gate_up, 8 rows: cuBLAS 69.5 us, ours 68.2 (a tie)
    (16, 5120, 13824): _tuned(64, 256, True, 4, 4),  # target.down, 8 rows: 40.9 -> 37.2 us
    (16, 152064, 5120): _tuned(128, 128, True, 4, 4),  # target.lm_head, 8 rows: 372.4 -> 351.1 us
}


def row_block(m: int) -> int:
    """The kernel's BLOCK_M for m rows, which is also TUNED's row bucket: m rounded up to a power of two >= 16."""
    return max(16, triton.next_power_of_2(m))


def pick_config(m: int, n: int, k: int) -> LinearConfig | None:
    """The tuned configuration of the shape, or None: F.linear (untuned, or cuBLAS measured as fast)."""
    return TUNED.get((row_block(m), n, k))


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          split_k, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                          EVEN_K: tl.constexpr, DOT_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
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
    gdc_launch_if(USE_GDC)  # the next PDL launch may be scheduled during this epilogue
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
                          workspace: SplitKWorkspace | None = None, out: torch.Tensor | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias with the Triton kernel; x [..., K] (rows flattened), weight [N, K]. pdl: launch with
    programmatic dependent launch where pdl_enabled (sm_90+)."""
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
    if M > 2 * MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {2 * MAX_ROWS} rows (got M={M}); larger M is a regular GEMM")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if config.split_k > 1:
        if workspace is None or not workspace.fits(M, N, config):
            raise ValueError(f"split_k={config.split_k} needs a SplitKWorkspace for M={M}, N={N} "
                             f"(SplitKWorkspace.allocate or .for_outputs); got {workspace}")
        part, counters = workspace.partials, workspace.counters
    else:
        part, counters = y, y  # unused
    block_m = row_block(M)
    grid = (triton.cdiv(N, config.block_n), config.split_k)
    _skinny_linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, part, counters, M, N, K, x2.stride(0), weight.stride(0),
        y.stride(0), config.split_k, HAS_BIAS=bias is not None, SPLIT=config.split_k > 1, SWAP=config.swap,
        EVEN_K=K % config.block_k == 0, DOT_MODE=dot_mode(x.dtype), BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **gdc_args(pdl and pdl_enabled(x.device)))
    return y.view(*lead, N)


@torch.library.custom_op("trtllm_dustin::skinny_linear", mutates_args=("partials", "counters"))
def _skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, partials: torch.Tensor | None,
                      counters: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    config = pick_config(M, N, K) if runs_triton(x) and 0 < M <= MAX_ROWS and x.dtype in _DTYPES else None
    workspace = None if partials is None or counters is None else SplitKWorkspace(partials, counters)
    if config is not None and config.split_k > 1 and (workspace is None or not workspace.fits(M, N, config)):
        config = None  # split-K needs the caller's workspace
    ties = pdl and pdl_enabled(x.device) and switched_on("TRTLLM_DUSTIN_SKINNY_TIES")
    if config is not None and config.tie and not ties:
        config = None  # a tie with cuBLAS gains only from the PDL launch
    if config is None:
        return skinny_linear_ref(x, weight, bias)
    return skinny_linear_forward(x, weight, bias, config, workspace, pdl=pdl)


@_skinny_linear_op.register_fake
def _(x, weight, bias, partials, counters, pdl) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  workspace: SplitKWorkspace | None = None, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized inputs: x [..., K] with at most MAX_ROWS rows in bf16 / fp16 and a
    shape in TUNED runs the Triton kernel (a split-K configuration only with a workspace; a tie with cuBLAS only on a
    PDL launch); anything else, and TRTLLM_DUSTIN_SKINNY_LINEAR=0, runs F.linear. pdl: launch with programmatic
    dependent launch where pdl_enabled (TRTLLM_DUSTIN_SKINNY_PDL=0 turns it off)."""
    if not switched_on("TRTLLM_DUSTIN_SKINNY_LINEAR"):
        return F.linear(x, weight, bias)
    pdl = pdl and switched_on("TRTLLM_DUSTIN_SKINNY_PDL")
    if workspace is None:
        return _skinny_linear_op(x, weight, bias, None, None, pdl)
    return _skinny_linear_op(x, weight, bias, workspace.partials, workspace.counters, pdl)
