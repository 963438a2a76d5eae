"""Ring attention: the ring drafter's own layers attending to their ring of the last W positions (issue 38).

The ring drafter (trtllm_dustin/models/ring_drafter.py) keeps, per own layer and sequence, one joined buffer of
R = C + G rows: C ring rows, each holding the keys and values of one committed position (`held` says which; -1:
none), then G slot rows, the round's proposals. A query reads
- the ring rows whose position lies in (bound - W, bound] (bound: the query's own position when committed positions
  enter the ring; the round's anchor L when a slot proposes), and
- the first `slots_read` slot rows (the proposals before it in the round).

One kernel replaces the masked attention the module code builds from these rules (the mask, the query-group folding,
the attention and the output transpose): a round at Γ = 7 runs it in each of 4 own layers for 6 slot steps and the
observe pass. It is latency-bound (a pair reads R rows of one KV head, about 140 KB at R = 271, D = 128): every query
row of one (sequence, KV head) pair is served from one read of the keys and values, as verify_attention's are, and
the rows are split over programs of 64 (a program looping over all R rows took 15 us per call on an H100, B = 8).
"""

import math

import torch
import triton
import triton.language as tl

from .checks import _HEAD_DIMS, check_out
from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_supported
from .split_kv import (
    LOG2E,
    NEG_BIG,
    dot_mode,
    merge_if_last,
    online_softmax_update,
    runs_triton,
    split_counters,
    store_split_result,
    tile_dot,
)

__all__ = ["ring_attention", "ring_attention_forward", "ring_attention_ref"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_N = 64  # key rows per tile: R = 271 (W = 256, Γ = 7) is five tiles
MAX_QUERY_ROWS = 64  # S * GROUP rows of one program's tile


def _visible(held: torch.Tensor, bound: torch.Tensor, window: int, slots_read: int, rows: int) -> torch.Tensor:
    """bool [B, S, R]: which of the R joined rows each query reads (the rules of the module docstring)."""
    h = held[:, None, :]  # [B, 1, C]
    b = bound[:, :, None]  # [B, S, 1]
    ring = (h >= 0) & (h <= b) & (h > b - window)  # [B, S, C]
    slot = torch.arange(rows - held.shape[1], device=held.device) < slots_read  # [R - C]
    return torch.cat([ring, slot[None, None].expand(*ring.shape[:2], -1)], dim=-1)


def ring_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor,
                       bound: torch.Tensor, window: int, slots_read: int,
                       softmax_scale: float | None = None) -> torch.Tensor:
    """Plain-PyTorch ring attention (float32, float64 for float64 inputs): q [B, S, H_q, D], keys / values
    [B, R, H_kv, D], held int [B, C], bound int [B, S] -> [B, S, H_q, D] in q's dtype; a query that reads no row
    gets zeros."""
    batch, s, heads_q, head_dim = q.shape
    heads_kv = keys.shape[2]
    group = heads_q // heads_kv
    cd = torch.promote_types(q.dtype, torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    visible = _visible(held.long(), bound.long(), window, slots_read, keys.shape[1])  # [B, S, R]
    qg = q.to(cd).reshape(batch, s, heads_kv, group, head_dim)
    scores = torch.einsum("bskgd,brkd->bskgr", qg, keys.to(cd)) * scale
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing visible: zeros, not NaN
    out = torch.einsum("bskgr,brkd->bskgd", probs, values.to(cd))
    return out.reshape(batch, s, heads_q, head_dim).to(q.dtype)


@triton.jit
def _ring_attention_kernel(
    q_ptr, k_ptr, v_ptr, held_ptr, bound_ptr, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, counters_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kr, stride_kh,
    stride_vb, stride_vr, stride_vh,
    stride_hb, stride_bb, stride_ob, stride_os, stride_oh,
    batch, num_kv_heads, ring_rows, slots_read, window, num_splits, qk_scale_log2,
    S: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr, DOT_MODE: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    """Program (split, pair): the BLOCK_N joined rows [split * BLOCK_N, ...) for the tile rows m = s * GROUP + g
    (query s, query head kv_head * GROUP + g) of one (sequence, KV head) pair."""
    split = tl.program_id(0)
    pair = tl.program_id(1)
    b = (pair // num_kv_heads).to(tl.int64)
    kv_head = (pair % num_kv_heads).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    s_row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = s_row < S
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
    q_off = b * stride_qb + s_row * stride_qs + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    bound = tl.load(bound_ptr + b * stride_bb + s_row, mask=row_ok, other=-1)  # [BLOCK_M]

    offs_n = split * BLOCK_N + tl.arange(0, BLOCK_N)
    in_ring = offs_n < ring_rows
    held = tl.load(held_ptr + b * stride_hb + offs_n, mask=in_ring, other=-1)  # [BLOCK_N]
    ring_ok = (held[None, :] >= 0) & (held[None, :] <= bound[:, None]) & (held[None, :] > bound[:, None] - window)
    visible = tl.where(in_ring[None, :], ring_ok, offs_n[None, :] < ring_rows + slots_read) & row_ok[:, None]
    # rows no query reads are not loaded: whatever they hold (a stale or never-written row) cannot reach the sums
    read = tl.max(visible.to(tl.int32), 0) > 0
    k = tl.load(k_ptr + b * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kr + offs_d[None, :],
                mask=read[:, None], other=0.0)
    v = tl.load(v_ptr + b * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vr + offs_d[None, :],
                mask=read[:, None], other=0.0)
    scores = tl.where(visible, tile_dot(q, tl.trans(k), DOT_MODE) * qk_scale_log2, float("-inf"))
    m_i, l_i, acc = online_softmax_update(scores, tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32),
                                          tl.zeros([BLOCK_M], dtype=tl.float32),
                                          tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32), v, DOT_MODE)
    gdc_launch_if(USE_GDC)
    if DIRECT_OUTPUT:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)  # nothing visible: zeros
        o_off = b * stride_ob + s_row * stride_os + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # the last of the pair's programs to finish merges the splits (no second launch)
        num_heads = num_kv_heads * GROUP
        store_split_result(acc, m_i, l_i, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, s_row, head, row_ok, offs_d,
                           split, num_splits, batch, S, num_heads, stride_ob, stride_os, stride_oh, HEAD_DIM, False)
        merge_if_last(counters_ptr + pair, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, s_row, head, row_ok, offs_d,
                      num_splits, batch, S, num_heads, stride_ob, stride_os, stride_oh, BLOCK_M, HEAD_DIM)


def ring_attention_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor,
                           bound: torch.Tensor, window: int, slots_read: int, softmax_scale: float, out: torch.Tensor,
                           pdl: bool = False) -> None:
    """Launch the ring attention kernel (inputs already validated).

    Launch contract:
      q:        [B, S, H_q, D] bf16 / fp16 / fp32, last dim contiguous, S * H_q / H_kv <= MAX_QUERY_ROWS
      keys, values: [B, R, H_kv, D] q.dtype, last dim contiguous, any other strides (the joined ring + slot rows)
      held:     int64 [B, C], C <= R - slots_read, last dim contiguous: the position each ring row holds (-1: none)
      bound:    int64 [B, S], last dim contiguous: ring rows in (bound - window, bound] are read
      slots_read: rows C .. C + slots_read - 1 are read by every query
      out:      [B, S, H_q, D] q.dtype, last dim contiguous (written; zeros where a query reads no row)
      grid:     (cdiv(C + slots_read, 64), B * H_kv); a program owns the [S * G, D] tile of one (b, kv head) and 64
                of the rows, so a round's few hundred rows spread over the SMs instead of looping in one program;
                with more than one split, the last program of a pair to finish merges the partials (arrival
                counters from split_counters)
      pdl:      programmatic dependent launch where pdl_supported
    """
    batch, s, heads_q, head_dim = q.shape
    heads_kv = keys.shape[2]
    group = heads_q // heads_kv
    if batch == 0:
        return
    block_m = max(16, triton.next_power_of_2(s * group))
    num_splits = max(1, triton.cdiv(held.shape[1] + slots_read, _BLOCK_N))
    direct = num_splits == 1
    if direct:
        lse = o_part = ml_part = counters = out  # unused
    else:
        lse = torch.empty(batch, s, heads_q, device=q.device, dtype=torch.float32)
        o_part = torch.empty(num_splits, batch, s, heads_q, head_dim, device=q.device, dtype=torch.float32)
        ml_part = torch.empty(2, num_splits, batch, s, heads_q, device=q.device, dtype=torch.float32)
        counters = split_counters(q.device, batch * heads_kv)
    _ring_attention_kernel[(num_splits, batch * heads_kv)](
        q, keys, values, held, bound, out, lse, o_part, ml_part, counters,
        q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        held.stride(0), bound.stride(0), out.stride(0), out.stride(1), out.stride(2),
        batch, heads_kv, held.shape[1], slots_read, window, num_splits, softmax_scale * LOG2E,
        S=s, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, DIRECT_OUTPUT=direct,
        DOT_MODE=dot_mode(q.dtype), num_warps=4, num_stages=1, **gdc_args(pdl and pdl_supported(q.device)),
    )


@torch.library.custom_op("trtllm_dustin::ring_attention", mutates_args=("out",))
def _ring_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor,
                       bound: torch.Tensor, window: int, slots_read: int, softmax_scale: float, out: torch.Tensor,
                       pdl: bool) -> None:
    if runs_triton(q):
        ring_attention_forward(q, keys, values, held, bound, window, slots_read, softmax_scale, out, pdl)
    else:
        out.copy_(ring_attention_ref(q, keys, values, held, bound, window, slots_read, softmax_scale))


@_ring_attention_op.register_fake
def _(q, keys, values, held, bound, window, slots_read, softmax_scale, out, pdl) -> None:
    return None


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor, bound: torch.Tensor,
           window: int, slots_read: int) -> None:
    op = "ring_attention"
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"{op}: q {tuple(q.shape)} and keys {tuple(keys.shape)} must be 4-dim: q [B, S, H_q, D], "
                         "keys / values [B, R, H_kv, D]")
    batch, s, heads_q, head_dim = q.shape
    if values.shape != keys.shape:
        raise ValueError(f"{op}: values {tuple(values.shape)} differ from keys {tuple(keys.shape)}; pass one "
                         "layer's joined keys and values")
    kb, rows, heads_kv, kd = keys.shape
    if kb != batch or kd != head_dim:
        raise ValueError(f"{op}: keys {tuple(keys.shape)} do not match q {tuple(q.shape)} in batch or head dim")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"{op}: head dim {head_dim} is not supported; use one of {_HEAD_DIMS}")
    if heads_q % heads_kv:
        raise ValueError(f"{op}: {heads_q} query heads are not a multiple of the {heads_kv} KV heads")
    if s < 1 or s * (heads_q // heads_kv) > MAX_QUERY_ROWS:
        raise ValueError(f"{op}: {s} queries x {heads_q // heads_kv} heads per KV head is outside 1 .. "
                         f"{MAX_QUERY_ROWS} tile rows; pass fewer queries at a time")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"{op}: q, keys and values are {q.dtype} / {keys.dtype} / {values.dtype}; all must be one "
                        "of bfloat16, float16, float32")
    for name, t in (("q", q), ("keys", keys), ("values", values), ("held", held), ("bound", bound)):
        if t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} is on {t.device} with last-dim stride {t.stride(-1)}; it must be on "
                             f"{q.device} with a contiguous last dim")
    if held.dim() != 2 or held.shape[0] != batch or held.dtype != torch.int64:
        raise ValueError(f"{op}: held is {held.dtype} {tuple(held.shape)}; expected int64 [{batch}, C]")
    if bound.shape != (batch, s) or bound.dtype != torch.int64:
        raise ValueError(f"{op}: bound is {bound.dtype} {tuple(bound.shape)}; expected int64 [{batch}, {s}]")
    if window < 1 or not 0 <= slots_read <= rows - held.shape[1]:
        raise ValueError(f"{op}: window {window} must be >= 1 and slots_read {slots_read} within 0 .. "
                         f"{rows - held.shape[1]} (the rows after the ring's {held.shape[1]})")


def ring_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor,
                   bound: torch.Tensor, window: int, slots_read: int, *, softmax_scale: float | None = None,
                   out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Attention of S queries per sequence over a ring drafter's joined buffer (module docstring): q [B, S, H_q, D],
    keys / values [B, R, H_kv, D], held int64 [B, C] (C <= R), bound int64 [B, S] -> out [B, S, H_q, D] in q's
    dtype. Ring row r is read by query s when held[b, r] lies in (bound[b, s] - window, bound[b, s]]; rows C ..
    C + slots_read - 1 by every query. Values of held and bound are not checked (that would stall the host).
    pdl: launch with programmatic dependent launch where the device supports it (KernelConfig.pdl)."""
    _check(q, keys, values, held, bound, window, slots_read)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out("ring_attention", out, q.shape, q.dtype, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _ring_attention_op(q, keys, values, held, bound, int(window), int(slots_read), float(scale), out, pdl)
    return out
