"""Skinny-M linear layer: y = x @ W^T (+ b) for the few token rows of a decode, draft or verify step.

At decode batch sizes (M = B * T = 16-64 rows) a projection reads its whole weight matrix to produce a few
rows, so it is a weight-streaming kernel: its time is weight bytes / bandwidth plus how unevenly the work
lands on the 132 SMs. cuBLAS picks wide tiles there (its kernel for Llama-8B's 64-row gate/up has 256 x 64
tiles: 112 of them for 132 SMs), which leaves SMs idle for the whole kernel.

This kernel tiles the output columns in BLOCK_N and optionally splits K into SPLIT_K slices so that the
grid covers every SM several times. With SWAP the tile product is computed as W_tile @ x_tile^T (BLOCK_N
rows in the MMA's M slot, where Hopper's wgmma wants 64), else x_tile @ W_tile^T. Which configuration a shape
takes is data: the tactic table of `KernelConfig` (plugins/linear_tactics.py; packaged:
tactics/skinny_linear_h200.json, the H200 sweeps of every bench_e2e pair, 0-16 % faster than cuBLAS). The decoder
launches it with PDL, which cuBLAS cannot do: each program waits for the previous kernel before its first read
and lets the next launch be scheduled once its main loop is done (worth 0.2 ms a Dustin-H round on the H200).
The sweeps and what else was tried: benchmarks/dev/README.md.

Split-K reduction without a second launch: each program stores its fp32 partial tile into `partials`
[SPLIT_K, M, N], then bumps the tile's counter; the program that arrives last sums the SPLIT_K partials in
slice order (deterministic), adds the bias, writes y, and resets the counter to 0 for the next call (so the
launch is replayable in a CUDA graph with the same buffers).

Weight-only int8 (a drafter's layers, `trtllm_dustin/models/quantize.py`): W int8 [N, K] with one fp32 scale per
output row, y = (x @ W^T) * scale (+ b). The kernel streams half the bytes of a bf16 weight: each tile is widened to
x's dtype after its load (exact: |q| <= 127), and the scale multiplies the fp32 accumulator once, in the epilogue.
Such a call runs the kernel wherever Triton runs and it has at most 2 * MAX_ROWS rows, since cuBLAS would need the
weight widened to bf16 first. Its configuration comes from the int8 tactic table of `KernelConfig` (packaged:
tactics/skinny_linear_int8_h200.json, a sweep of the drafters' int8 calls by benchmarks/dev/bench_int8_linear.py);
a shape that table does not list takes the bf16 table's configuration, else QUANTIZED_CONFIG.

Launch contract (`skinny_linear_forward`): x [M, K] with unit stride along K, W [N, K] contiguous, bias [N]
or None, all one dtype (bf16 / fp16 / fp32), or W int8 with scale [N] (any float dtype); y [M, N] in x's dtype;
with SPLIT_K > 1 a SplitKWorkspace (fp32 partials of >= SPLIT_K * M * N, int32 counters of >= cdiv(N, BLOCK_N),
zero). Grid (cdiv(N, BLOCK_N), SPLIT_K). One workspace may serve every launch of a stream: a launch resets its
counters before it ends.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kernel_config import KernelConfig
from .linear_tactics import LinearConfig, row_block
from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_supported
from .split_kv import dot_mode, runs_triton, tile_dot

__all__ = ["DEFAULT_KERNELS", "MAX_ROWS", "QUANTIZED_CONFIG", "SplitKWorkspace", "pick_config", "skinny_linear",
           "skinny_linear_forward", "skinny_linear_ref"]

MAX_ROWS = 64  # more rows than this (prefill chunks) are a regular GEMM: F.linear
_DTYPES = (torch.bfloat16, torch.float16)  # what the op runs on the kernel (fp32: F.linear)
# an int8 weight's shape that neither the int8 table nor the bf16 one lists (no sweep measured it): one program per
# 64 output columns, no split
QUANTIZED_CONFIG = LinearConfig(block_n=64, block_k=128, split_k=1, swap=True, num_warps=4, num_stages=4)


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


def pick_config(kernels: KernelConfig, x: torch.Tensor, weight: torch.Tensor,
                workspace: SplitKWorkspace | None) -> LinearConfig | None:
    """The kernel configuration a call takes, or None for F.linear: the tactic table's entry for the shape
    (a shape not in the table runs F.linear), for 1..MAX_ROWS rows in bf16 / fp16 where Triton runs; a split-K
    entry only with a workspace that fits, a tie only on a PDL launch with `kernels.skinny_ties`. An int8 weight
    takes the kernel for 1..2 * MAX_ROWS rows: the int8 table's entry (`kernels.int8_tactics`), else the bf16
    table's, else QUANTIZED_CONFIG; either entry without its split where no workspace fits. A bf16 / fp16 weight
    never reads the int8 table."""
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    quantized = weight.dtype == torch.int8
    rows = 2 * MAX_ROWS if quantized else MAX_ROWS
    if not kernels.skinny_linear or not runs_triton(x) or not 0 < M <= rows or x.dtype not in _DTYPES:
        return None
    if quantized:
        tactic = kernels.int8_tactics.lookup(M, N, K)  # every entry has a config (linear_tactics.py)
        if tactic is None and M <= MAX_ROWS:
            tactic = kernels.tactics.lookup(M, N, K)
        config = tactic.config if tactic is not None and tactic.config is not None else QUANTIZED_CONFIG
        if config.split_k > 1 and (workspace is None or not workspace.fits(M, N, config)):
            config = replace(config, split_k=1)
        return config
    tactic = kernels.tactics.lookup(M, N, K)
    if tactic is None or tactic.config is None:
        return None
    if tactic.config.split_k > 1 and (workspace is None or not workspace.fits(M, N, tactic.config)):
        return None  # split-K needs the caller's workspace
    if tactic.tie and not (kernels.skinny_ties and kernels.skinny_launch_pdl and pdl_supported(x.device)):
        return None  # a tie with cuBLAS gains only from the PDL launch
    return tactic.config


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); with an int8 weight and its per-row scale, the product is taken in fp32 (fp64 for
    fp64 x; a transient copy of the weight), scaled and biased there, and rounded once to x's dtype, as the kernel
    does."""
    if scale is None:
        return F.linear(x, weight, bias)
    wide = torch.promote_types(x.dtype, torch.float32)
    y = F.linear(x.to(wide), weight.to(wide)) * scale.to(wide)
    return (y if bias is None else y + bias.to(wide)).to(x.dtype)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                          stride_ym, split_k, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT: tl.constexpr,
                          SWAP: tl.constexpr, EVEN_K: tl.constexpr, DOT_MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
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
        if HAS_SCALE:  # int8 -> x's dtype, exact; the row scales wait for the epilogue
            if DOT_MODE == "upcast":
                w = w.to(tl.float32)  # the interpreter's bf16 dot runs in fp32 anyway (split_kv.dot_mode)
            else:
                w = w.to(x.dtype)
        if SWAP:
            acc += tile_dot(w, tl.trans(x), DOT_MODE)
        else:
            acc += tile_dot(x, tl.trans(w), DOT_MODE)
    gdc_launch_if(USE_GDC)  # the next PDL launch may be scheduled during this epilogue
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    y_tile = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if HAS_SCALE:
        row_scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if not SPLIT:
        if HAS_SCALE:
            acc = acc * row_scale
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
            if HAS_SCALE:
                total = total * row_scale
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_tile, total.to(y_ptr.dtype.element_ty), mask=tile_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def skinny_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: LinearConfig,
                          workspace: SplitKWorkspace | None = None, out: torch.Tensor | None = None,
                          pdl: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias with the Triton kernel; x [..., K] (rows flattened), weight [N, K]; an int8 weight
    with its per-row scale [N]: y = (x @ weight^T) * scale + bias. pdl: launch with programmatic dependent launch
    where pdl_supported (sm_90+)."""
    *lead, K = x.shape
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dim {K}")
    quantized = weight.dtype == torch.int8
    if quantized != (scale is not None):
        raise ValueError("an int8 weight needs its per-row scale, and only an int8 weight takes one; got weight "
                         f"{weight.dtype} with scale {None if scale is None else tuple(scale.shape)}")
    if quantized and (tuple(scale.shape) != (N,) or not scale.is_floating_point() or not scale.is_contiguous()):
        raise ValueError(f"scale must be a contiguous float tensor [{N}] (one per weight row); got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if (not quantized and weight.dtype != x.dtype) or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype (or the weight be int8 with a scale); got {x.dtype}, "
                         f"{weight.dtype}, {None if bias is None else bias.dtype}")
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
        x2, weight, bias if bias is not None else weight, scale if quantized else weight, y, part, counters, M, N, K,
        x2.stride(0), weight.stride(0), y.stride(0), config.split_k, HAS_BIAS=bias is not None, HAS_SCALE=quantized,
        SPLIT=config.split_k > 1, SWAP=config.swap,
        EVEN_K=K % config.block_k == 0, DOT_MODE=dot_mode(x.dtype), BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **gdc_args(pdl and pdl_supported(x.device)))
    return y.view(*lead, N)


@torch.library.custom_op("trtllm_dustin::skinny_linear", mutates_args=("partials", "counters"))
def _skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                      partials: torch.Tensor | None, counters: torch.Tensor | None, block_n: int, block_k: int,
                      split_k: int, swap: bool, num_warps: int, num_stages: int, pdl: bool) -> torch.Tensor:
    # The LinearConfig travels as plain values: a custom op takes no dataclass.
    config = LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k, swap=swap, num_warps=num_warps,
                          num_stages=num_stages)
    workspace = None if partials is None or counters is None else SplitKWorkspace(partials, counters)
    return skinny_linear_forward(x, weight, bias, config, workspace, pdl=pdl, scale=scale)


@_skinny_linear_op.register_fake
def _(x, weight, bias, scale, partials, counters, block_n, block_k, split_k, swap, num_warps, num_stages, pdl
      ) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


DEFAULT_KERNELS = KernelConfig()  # the packaged tactic tables (bf16 and int8), every kernel path on


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  workspace: SplitKWorkspace | None = None, *, kernels: KernelConfig = DEFAULT_KERNELS,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized inputs: x [..., K] with at most MAX_ROWS rows in bf16 / fp16 and a
    shape that `kernels`' tactic table gives a configuration runs the Triton kernel (a split-K configuration only
    with a workspace; a tie with cuBLAS only on a PDL launch with kernels.skinny_ties); anything else runs F.linear.
    A shape not in the table runs F.linear (cuBLAS), because the kernel was only kept where a sweep measured it at
    least 2 % faster (or tied, for PDL launches): SmolLM2-135M's projections (hidden 576) are such shapes.
    An int8 weight with its per-row `scale` (weight-only quantization) runs the kernel for up to 2 * MAX_ROWS rows
    wherever Triton runs (pick_config), else skinny_linear_ref's widened copy.
    kernels.skinny_linear=False runs F.linear throughout; the launch uses PDL when kernels.pdl and
    kernels.skinny_pdl and the device supports it."""
    config = pick_config(kernels, x, weight, workspace)
    if config is None:
        return skinny_linear_ref(x, weight, bias, scale)
    partials, counters = (None, None) if workspace is None else (workspace.partials, workspace.counters)
    return _skinny_linear_op(x, weight, bias, scale, partials, counters, config.block_n, config.block_k,
                             config.split_k, config.swap, config.num_warps, config.num_stages,
                             kernels.skinny_launch_pdl)
