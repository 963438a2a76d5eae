"""Split-KV (flash-decoding) plumbing shared by the two attention ops.

A decode/verify step has only B * H_kv (sequence, KV head) pairs, too few to fill 132 SMs at
batch 8-16, so each pair's keys are cut into `num_splits` chunks, every chunk writes an
unnormalised partial output plus its running max and denominator, and the chunks are merged with
the usual log-sum-exp rescaling: by a second launch (`combine_splits`) or, without one, by the last
program of each pair to finish (`merge_if_last`, arrival counters from `split_counters`; the sparse
kernel does this). Everything is in base 2 inside the kernels (`exp2` is one instruction); the
log-sum-exp handed back to callers is natural log.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import launch_table
from .pdl import gdc_args, gdc_wait_if

__all__ = [
    "INTERPRET",
    "LOG2E",
    "NEG_BIG",
    "combine_splits",
    "dot_mode",
    "interpreting",
    "merge_if_last",
    "merge_split_rows",
    "num_sms",
    "online_softmax_update",
    "pick_num_splits",
    "runs_triton",
    "split_counters",
    "store_split_result",
    "tile_dot",
]

LOG2E = 1.4426950408889634
# Running-max start value: finite so that a row whose keys are all masked in a chunk gives
# alpha = exp2(0) = 1 and p = exp2(-inf) = 0 instead of NaN from (-inf) - (-inf).
NEG_BIG = tl.constexpr(-1.0e30)
# A split-KV launch aims at about one program per SM, the fastest split count in the H200 sweep
# (benchmarks/dev/README.md); more splits only add partials.
MAX_SPLITS = 64
# Triton's interpreter (TRITON_INTERPRET=1: CI without a GPU) is chosen when a kernel is decorated, at import; the
# switch is read once here, at import too, so that the ops dispatch as the kernels were built. Tests that want the
# PyTorch references on CPU tensors patch this flag (tests/conftest.py `plugin_references`).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the Triton kernels run in Triton's interpreter (INTERPRET, read at import)."""
    return INTERPRET


def runs_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors, and on CPU tensors when the Triton interpreter is on (CI)."""
    return t.is_cuda or interpreting()


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; a small stand-in on the CPU so interpreter runs stay cheap."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pick_num_splits(pairs: int, max_keys: int, min_keys_per_split: int, device: torch.device,
                    programs_per_sm: int = 1) -> int:
    """Splits per (sequence, KV head) pair from host-known sizes only (no host sync).

    pairs: B * H_kv programs per split; max_keys: static upper bound on the keys one pair visits;
    min_keys_per_split: below this a chunk is too short to hide the partial-output traffic;
    programs_per_sm: the launch's target occupancy (kernels with small tiles want more than 1).
    """
    wanted = round(programs_per_sm * num_sms(device) / pairs)
    by_length = triton.cdiv(max_keys, min_keys_per_split)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def dot_mode(dtype: torch.dtype) -> str:
    """How tile_dot multiplies: fp32 inputs (tests) get exact fp32 products ("ieee"); 16-bit
    inputs use the tensor cores ("tf32" is ignored for them). Triton 3.9's interpreter computes
    bf16 dots wrongly, so there the operands are upcast to fp32 first ("upcast")."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"


@triton.jit
def tile_dot(a, b, DOT_MODE: tl.constexpr):
    """tl.dot with fp32 accumulation, in the mode dot_mode() picked for the operand dtype."""
    if DOT_MODE == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_MODE)
    return c


@triton.jit
def online_softmax_update(scores, m_i, l_i, acc, v, DOT_MODE: tl.constexpr):
    """One key block of the online softmax. scores: [M, N] fp32 in log2 units, masked to -inf;
    m_i, l_i: [M] running max and denominator; acc: [M, D] fp32; v: [N, D] in the cache dtype."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_MODE)
    return m_new, l_i, acc


@triton.jit
def store_split_result(acc, m_i, l_i, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d,
                       split, num_splits, batch, T, num_heads, stride_ob, stride_ot, stride_oh,
                       HEAD_DIM: tl.constexpr, DIRECT_OUTPUT: tl.constexpr):
    """A program's result for its query rows: with one split, the normalised output and the natural-log lse;
    otherwise the unnormalised partial output and its running max / denominator for combine_splits."""
    if DIRECT_OUTPUT:
        out_off = b.to(tl.int64) * stride_ob + t_row * stride_ot + head * stride_oh
        o = acc / l_i[:, None]
        tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        lse_off = (b * T + t_row) * num_heads + head
        tl.store(lse_ptr + lse_off, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    else:
        rows = batch * T * num_heads
        row = (b * T + t_row) * num_heads + head
        part_off = (split * rows + row).to(tl.int64) * HEAD_DIM
        tl.store(o_part_ptr + part_off[:, None] + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_part_ptr + split * rows + row, m_i, mask=row_ok)
        tl.store(ml_part_ptr + (num_splits + split) * rows + row, l_i, mask=row_ok)


@triton.jit
def merge_split_rows(out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d, num_splits, batch, T,
                     num_heads, stride_ob, stride_ot, stride_oh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """combine_splits for one program's rows, inside the kernel (partials read past L1: other SMs wrote them)."""
    rows = batch * T * num_heads
    row = (b * T + t_row) * num_heads + head
    m_max = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    for s in range(num_splits):
        m_s = tl.load(ml_part_ptr + s * rows + row, mask=row_ok, other=NEG_BIG, cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    o = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(num_splits):
        m_s = tl.load(ml_part_ptr + s * rows + row, mask=row_ok, other=NEG_BIG, cache_modifier=".cg")
        l_s = tl.load(ml_part_ptr + (num_splits + s) * rows + row, mask=row_ok, other=0.0, cache_modifier=".cg")
        w = tl.exp2(m_s - m_max)
        denom += w * l_s
        part = (s * rows + row).to(tl.int64) * HEAD_DIM
        o_s = tl.load(o_part_ptr + part[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                      cache_modifier=".cg")
        o += w[:, None] * o_s
    denom = tl.where(row_ok, denom, 1.0)
    # a row that read nothing (every split's denominator 0; only the ring drafter's invalid entries) gets zeros;
    # any other has denom >= 1 (the split holding the max contributes its own l >= 1)
    o = tl.where(denom[:, None] > 0, o / tl.maximum(denom, 1e-30)[:, None], 0.0)
    out_off = b.to(tl.int64) * stride_ob + t_row * stride_ot + head * stride_oh
    tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + row, (m_max + tl.log2(denom)) * 0.6931471805599453, mask=row_ok)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for fused split merging, one buffer per (device, stream), kept between launches
    (each launch leaves them at zero). Grown outside CUDA-graph capture; a capture that needs more gets its own
    zeroed buffer (a memset node in the graph) instead of caching memory from the graph's pool."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _COUNTERS[key] = fresh
    return fresh


@triton.jit
def merge_if_last(counter_ptr, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d, num_splits,
                  batch, T, num_heads, stride_ob, stride_ot, stride_oh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """After store_split_result: count this program in at its rows' arrival counter; the last of the num_splits
    programs to arrive merges the partials (combine_splits inside the kernel) and resets the counter to 0."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch (graph replays too)
        merge_split_rows(out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d, num_splits,
                         batch, T, num_heads, stride_ob, stride_ot, stride_oh, BLOCK_M, HEAD_DIM)


@triton.jit
def _combine_splits_kernel(
    o_part_ptr, ml_part_ptr, out_ptr, lse_ptr,
    stride_ob, stride_ot, stride_oh,
    rows, num_splits,
    T: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """One program per output row (b, t, h): merge its num_splits partials."""
    gdc_wait_if(USE_GDC)  # the partials come from the previous kernel
    row = tl.program_id(0)
    h = row % NUM_HEADS
    t = (row // NUM_HEADS) % T
    b = row // (NUM_HEADS * T)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    m = tl.load(ml_part_ptr + offs_s * rows + row, mask=split_ok, other=float("-inf"))
    denoms = tl.load(ml_part_ptr + (num_splits + offs_s) * rows + row, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * denoms, 0)
    part_rows = (offs_s.to(tl.int64) * rows + row) * HEAD_DIM
    o = tl.load(o_part_ptr + part_rows[:, None] + offs_d[None, :], mask=split_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * o, 0) / denom
    out_off = b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh
    tl.store(out_ptr + out_off + offs_d, o.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, (m_max + tl.log2(denom)) * 0.6931471805599453)


def combine_splits(o_part: torch.Tensor, ml_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                   pdl: bool = False) -> None:
    """Merge split-KV partials into `out` and `lse`.

    Launch contract:
      o_part:  fp32 [S, B, T, H, D] contiguous, unnormalised sum_j 2^(s_j - m) v_j per split
      ml_part: fp32 [2, S, B, T, H] contiguous: running max m (log2 units) and denominator l
      out:     [B, T, H, D] any float dtype, last dim contiguous (written)
      lse:     fp32 [B, T, H] contiguous, natural-log softmax denominator (written)
      grid:    (B * T * H,), one program per output row
      pdl:     launch with programmatic dependent launch (the kernel waits for its predecessor first)
    """
    num_splits, batch, t, heads, head_dim = o_part.shape
    rows = batch * t * heads
    _combine_splits_kernel[(rows,)](
        o_part, ml_part, out, lse,
        out.stride(0), out.stride(1), out.stride(2),
        rows, num_splits,
        T=t, NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        num_warps=launch_table(out.device).combine_splits.num_warps, **gdc_args(pdl),
    )
