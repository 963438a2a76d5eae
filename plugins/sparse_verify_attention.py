"""Sparse verification attention (paper Sec. 4.1): attend only to the selected KV entries.

Query token t of sequence b attends to {indices[b, i] : indices[b, i] >= 0} (context positions
chosen by Eq. 6, unique, in [0, L_b)) plus the new tokens L_b .. L_b + t; with indices [B, H_kv, K]
each KV head reads its own set (per-KV-head verification, an evaluation option). The kernel walks a
virtual key list of K + T items (the K index slots, then the T new tokens), gathers each item's
K/V row and skips padding (-1); the index order does not matter. GQA sharing and split-KV are
as in verify_attention: one program serves all T * G rows of a (sequence, KV head) pair.
"""

import math

import torch
import triton
import triton.language as tl

from .checks import check_attention_inputs, check_out
from .kv_dtype import compute_q
from .launch import launch_table
from .pdl import gdc_args, gdc_wait_if, pdl_supported
from .reference import sparse_verify_attention_ref
from .split_kv import (
    LOG2E,
    NEG_BIG,
    dot_mode,
    merge_if_last,
    online_softmax_update,
    pick_num_splits,
    runs_triton,
    split_counters,
    store_split_result,
    tile_dot,
)

__all__ = ["sparse_verify_attention", "sparse_verify_attention_forward", "split_counters"]

# The chosen launch (its numbers in launch.py's table; the H200 sweeps and what else was tried: benchmarks/dev/
# README.md): the next index block is loaded during each gather, 64-key tiles, 3 stages, 4 warps, splits of at least
# 1024 items (the chunks are short: partial outputs cost more than extra splits gain); above 16 query rows one
# 64-row (wgmma) tile with `lean`, because the kernel is bound by instruction issue, not DRAM; at most 16 rows a
# 16-row tile with the new tokens folded in after the walk; PDL whose programs signal the next launch only by
# exiting.


@triton.jit
def _query_rows(q_ptr, offs_m, b, kv_head, stride_qb, stride_qt, stride_qh, offs_d, T: tl.constexpr,
                GROUP: tl.constexpr):
    """Tile rows r = t * GROUP + g: token t, query head kv_head * GROUP + g; their queries (rows past T * G zero)."""
    t_row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = t_row < T
    q_off = b.to(tl.int64) * stride_qb + t_row * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    return q, t_row, head, row_ok


@triton.jit
def _visible(col_ok, from_list, new_token, t_row):
    """[M, N] mask: a valid list item is visible to every row, new token j to the rows of query tokens t >= j."""
    return col_ok[None, :] & (from_list[None, :] | (new_token[None, :] <= t_row[:, None]))


@triton.jit
def _attend(q, k, v, t_row, col_ok, from_list, new_token, m_i, l_i, acc, qk_scale_log2, DOT_MODE: tl.constexpr):
    """One key tile for one row tile, masked by _visible."""
    scores = tile_dot(q, tl.trans(k), DOT_MODE) * qk_scale_log2
    scores = tl.where(_visible(col_ok, from_list, new_token, t_row), scores, float("-inf"))
    return online_softmax_update(scores, m_i, l_i, acc, v, DOT_MODE)


@triton.jit
def _softmax_step_raw(raw, qk_scale_log2, m_i, l_i, acc, v, DOT_MODE: tl.constexpr):
    """online_softmax_update on unscaled scores (masked to -inf): the scale is folded into the exponent, one fused
    multiply-add per score instead of a multiply and a subtract."""
    m_new = tl.maximum(m_i, tl.max(raw, 1) * qk_scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(raw * qk_scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_MODE)
    return m_new, l_i, acc


@triton.jit
def _sparse_verify_attention_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, indices_ptr, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ih,
    stride_ob, stride_ot, stride_oh,
    batch, num_kv_heads, num_indices, num_splits, qk_scale_log2,
    T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT_OUTPUT: tl.constexpr, DOT_MODE: tl.constexpr, counters_ptr,
    NEW_SEPARATE: tl.constexpr = False, BLOCK_T: tl.constexpr = 16, USE_GDC: tl.constexpr = False,
    LEAN: tl.constexpr = False,
):
    split = tl.program_id(0) // ROW_BLOCKS
    row_block = tl.program_id(0) % ROW_BLOCKS
    pair = tl.program_id(1)
    b = pair // num_kv_heads
    kv_head = pair % num_kv_heads
    num_heads = num_kv_heads * GROUP

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    idx_base = indices_ptr + b.to(tl.int64) * stride_ib + kv_head.to(tl.int64) * stride_ih  # stride_ih 0: one set
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
    q, t_row, head, row_ok = _query_rows(q_ptr, offs_m, b, kv_head, stride_qb, stride_qt, stride_qh, offs_d, T, GROUP)
    q = compute_q(q, k_ptr)
    seqlen = tl.load(seqlens_ptr + b)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    if NEW_SEPARATE:
        # The T new tokens are not items of the walk: the last split gathers their K/V here, before the loop, so
        # those loads overlap the walk, and folds them in after it; the walk covers the K index slots only, so
        # k = 512 is 8 tiles of 64 rather than 8 full tiles and a ninth holding the T new tokens.
        n_items = num_indices
        offs_j = tl.arange(0, BLOCK_T)
        new_ok = offs_j < tl.where(split == num_splits - 1, T, 0)
        pos_new = seqlen + offs_j
        k_new = tl.load(k_base + pos_new[:, None] * stride_ks + offs_d[None, :], mask=new_ok[:, None], other=0.0)
        k_new = k_new.to(q.dtype)  # an fp8 cache is read as q's dtype
        v_new = tl.load(v_base + pos_new[:, None] * stride_vs + offs_d[None, :], mask=new_ok[:, None], other=0.0)
        v_new = v_new.to(q.dtype)  # an fp8 cache is read as q's dtype
    else:
        n_items = num_indices + T
    chunk = tl.cdiv(tl.cdiv(n_items, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_items)

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The next index block is loaded during this block's gathers, which then wait on no index load of their own.
    offs_first = start + tl.arange(0, BLOCK_N)
    idx_next = tl.load(idx_base + offs_first, mask=offs_first < num_indices, other=-1)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        from_list = offs_n < num_indices
        new_token = offs_n - num_indices  # index among the T new tokens, for items past the list
        idx = idx_next
        offs_after = offs_n + BLOCK_N
        idx_next = tl.load(idx_base + offs_after, mask=offs_after < num_indices, other=-1)
        pos = tl.where(from_list, idx, seqlen + new_token)
        col_ok = (offs_n < end) & (pos >= 0)
        if LEAN:
            # K and V rows at one offset (the launcher checks stride_vs == stride_ks). A clean tile (64 valid list
            # items, no new token, not past the chunk) needs no mask at all; the others get the full one.
            kv_off = pos[:, None] * stride_ks + offs_d[None, :]
            k = tl.load(k_base + kv_off, mask=col_ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_base + kv_off, mask=col_ok[:, None], other=0.0).to(q.dtype)
            raw = tile_dot(q, tl.trans(k), DOT_MODE)
            if (n0 + BLOCK_N > tl.minimum(end, num_indices)) | (tl.min(idx, 0) < 0):
                raw = tl.where(_visible(col_ok, from_list, new_token, t_row), raw, float("-inf"))
            m_i, l_i, acc = _softmax_step_raw(raw, qk_scale_log2, m_i, l_i, acc, v, DOT_MODE)
        else:
            k = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            k = k.to(q.dtype)  # an fp8 cache is read as q's dtype
            v = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            v = v.to(q.dtype)  # an fp8 cache is read as q's dtype
            m_i, l_i, acc = _attend(q, k, v, t_row, col_ok, from_list, new_token, m_i, l_i, acc, qk_scale_log2,
                                    DOT_MODE)
    if NEW_SEPARATE:  # new token j is visible to query token t when j <= t (causal among the T new tokens)
        m_i, l_i, acc = _attend(q, k_new, v_new, t_row, new_ok, offs_j < 0, offs_j, m_i, l_i, acc, qk_scale_log2,
                                DOT_MODE)
    # PDL: no early gdc_launch_dependents here; the next launch is scheduled as the programs exit (faster, H200).

    store_split_result(acc, m_i, l_i, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d,
                       split, num_splits, batch, T, num_heads, stride_ob, stride_ot, stride_oh, HEAD_DIM, DIRECT_OUTPUT)
    if not DIRECT_OUTPUT:  # the last program of this (pair, row block) to finish merges the splits: no second launch
        merge_if_last(counters_ptr + pair * ROW_BLOCKS + row_block, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b,
                      t_row, head, row_ok, offs_d, num_splits, batch, T, num_heads, stride_ob, stride_ot, stride_oh,
                      BLOCK_M, HEAD_DIM)


def sparse_verify_attention_forward(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale, out, lse, *,
                                    num_splits=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
                                    new_separate=None, lean=None, pdl=False):
    """Launch the sparse verify attention kernel (inputs already validated).

    None is the chosen launch (launch.py's table); explicit values are for the tests and the sweeps (benchmarks/dev/).
    block_m: query rows per program (None: 64 when T * G > 16, else 16; a 64-row tile takes Hopper's wgmma, smaller
    ones mma.sync); an explicit value is cut to the smallest power of two >= T * G.
    new_separate: gather the T new tokens' K/V before the index walk and fold them in after it (None: when
    block_m <= 32); otherwise they are the last T items of the walk.
    lean (None: with 64-row tiles): tiles of valid list items only skip the mask, K and V rows share one offset
    (needs equal position strides, else off), the softmax scale goes into the exponent.
    pdl: programmatic dependent launch where pdl_supported; the kernel reads nothing before the previous kernel
    has completed and signals the next launch only by exiting.

    Launch contract:
      q:             [B, T, H_q, D], T <= 16, last dim contiguous, bf16 / fp16 / fp32
      k_cache, v_cache: [B, H_kv, S_max, D] same dtype (q's, or float8_e4m3fn: plugins/kv_dtype.py), last dim
                     contiguous, any other strides
      cache_seqlens: int32 [B], L_b; positions L_b .. L_b + T - 1 already hold the new tokens
      indices:       int32 [B, K] (one set for every head) or [B, H_kv, K] (a set per KV head), last dim
                     contiguous; valid entries unique in [0, L_b), padding -1
      out:           [B, T, H_q, D] q.dtype, last dim contiguous (written)
      lse:           fp32 [B, T, H_q] contiguous (written, natural log over the attended set)
      grid:          (num_splits * row_blocks, B * H_kv); a program owns block_m of the T * G rows
                     of one (b, kv head) (row_blocks = cdiv(T * G, block_m): the programs of one
                     pair gather the same rows, the repeats served from L2) and items
                     [split * chunk, (split + 1) * chunk) of the K + T item list;
                     num_splits > 1: the last program of each (pair, row block) to finish merges the
                     partials (arrival counters from split_counters), so there is no second launch.
    """
    batch, t, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    num_indices = indices.shape[-1]
    group = heads_q // heads_kv
    choice = launch_table(q.device).sparse_verify_attention
    if num_splits is None:
        num_splits = pick_num_splits(batch * heads_kv, num_indices + t, choice.min_keys_per_split, q.device)
    block_n = choice.block_n if block_n is None else block_n
    num_warps = choice.num_warps if num_warps is None else num_warps
    num_stages = choice.num_stages if num_stages is None else num_stages
    rows = t * group
    if block_m is None:  # a 64-row (wgmma) tile above 16 rows, even when fewer would hold them
        block_m = choice.tile_rows if rows > choice.small_tile_rows else choice.small_tile_rows
    else:
        block_m = min(max(16, block_m), max(16, triton.next_power_of_2(rows)))
    row_blocks = triton.cdiv(rows, block_m)
    if new_separate is None:  # faster at <= 32 rows, slower in a 64-row tile (H200)
        new_separate = block_m <= 32
    if lean is None:
        lean = block_m >= 64
    lean = lean and k_cache.stride(2) == v_cache.stride(2)
    direct = num_splits == 1
    use_gdc = pdl and pdl_supported(q.device)
    counters = cache_seqlens if direct else split_counters(q.device, batch * heads_kv * row_blocks)  # else unused
    if direct:
        o_part = ml_part = out  # unused
    else:
        o_part = torch.empty(num_splits, batch, t, heads_q, head_dim, device=q.device, dtype=torch.float32)
        ml_part = torch.empty(2, num_splits, batch, t, heads_q, device=q.device, dtype=torch.float32)
    _sparse_verify_attention_kernel[(num_splits * row_blocks, batch * heads_kv)](
        q, k_cache, v_cache, cache_seqlens, indices, out, lse, o_part, ml_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        indices.stride(0), indices.stride(1) if indices.dim() == 3 else 0,
        out.stride(0), out.stride(1), out.stride(2),
        batch, heads_kv, num_indices, num_splits, softmax_scale * LOG2E,
        T=t, GROUP=group, HEAD_DIM=head_dim, ROW_BLOCKS=row_blocks, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT_OUTPUT=direct, DOT_MODE=dot_mode(q.dtype), counters_ptr=counters, NEW_SEPARATE=new_separate,
        BLOCK_T=max(16, triton.next_power_of_2(t)), LEAN=lean,
        num_warps=num_warps, num_stages=num_stages, **gdc_args(use_gdc),
    )


@torch.library.custom_op("trtllm_dustin::sparse_verify_attention", mutates_args=("out",))
def _sparse_verify_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cache_seqlens: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                                out: torch.Tensor, pdl: bool) -> None:
    if runs_triton(q):
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        sparse_verify_attention_forward(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale, out, lse, pdl=pdl)
    else:
        out.copy_(sparse_verify_attention_ref(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale))


@_sparse_verify_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale, out, pdl) -> None:
    return None


def sparse_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, indices: torch.Tensor, *,
                            softmax_scale: float | None = None, out: torch.Tensor | None = None,
                            pdl: bool = False) -> torch.Tensor:
    """Attention of T new tokens over the selected cache entries plus the new tokens (causal).

    q [B, T, H_q, D]; k_cache, v_cache [B, H_kv, S_max, D]; cache_seqlens int32 [B];
    indices int32 [B, K]: valid entries unique in [0, L_b) in any order, padding -1 (skipped); or [B, H_kv, K], a
    set per KV head (each KV head reads its own rows).
    Returns out [B, T, H_q, D] in q.dtype. pdl: launch with programmatic dependent launch where the device
    supports it (KernelConfig.pdl).
    """
    check_attention_inputs("sparse_verify_attention", q, k_cache, v_cache, cache_seqlens)
    batch, t, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    per_head = indices.dim() == 3 and indices.shape[1] == heads_kv
    if not (indices.dim() == 2 or per_head) or indices.shape[0] != batch or indices.dtype != torch.int32:
        raise ValueError(f"sparse_verify_attention: indices is {indices.dtype} {tuple(indices.shape)}; "
                         f"expected int32 [{batch}, K] or [{batch}, {heads_kv}, K] (pad unused slots with -1)")
    if indices.device != q.device:
        raise ValueError(f"sparse_verify_attention: indices is on {indices.device} but q is on {q.device}")
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out("sparse_verify_attention", out, q.shape, q.dtype, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    _sparse_verify_attention_op(q, k_cache, v_cache, cache_seqlens, indices, float(scale), out, pdl)
    return out
