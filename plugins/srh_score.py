"""Semantic-Retrieval-Head importance scores (paper Eq. 5 restricted to SRHs, Sec. 4.2.3, App. A).

S[b, j] = sum_{h in head_ids} sum_t p(b, t, h, j) for context positions j < L_b, where p is the
softmax probability that query (b, t, h) (at position L_b + t) puts on key j, normalised over
the keys it attends to in the model: the causal range [0, L_b + t]. S[b, j] = 0 for j >= L_b.

The probability matrix is never written: one program owns a block of key positions of one
sequence, reads each needed K block once for every selected head sharing that KV head, and
writes (or adds) the column sums. With `lse` from the attention call on the same queries this is
one pass over K; without it the pass over K computes the log-denominators and keeps the selected
rows' scores, and a light second kernel turns them into probabilities (the [B, T, heads, L] score
rows of a few SRHs are written, never the probabilities of all heads).

The selected heads are regrouped on the host by KV head: group g holds up to P query heads of
KV head kv_g. The kernels take the groups' KV heads and sizes packed 8 bits each into one int64
(static Python ints, so nothing is copied to the device and the op stays graph-capturable).
"""

import math

import torch
import triton
import triton.language as tl

from .checks import check_attention_inputs, check_out
from .kv_dtype import compute_q
from .launch import launch_table
from .pdl import gdc_args, gdc_wait_if, pdl_supported
from .reference import srh_score_ref
from .split_kv import LOG2E, NEG_BIG, dot_mode, pick_num_splits, runs_triton, tile_dot

__all__ = ["srh_score", "srh_score_forward"]

MAX_GROUPS_PER_LAUNCH = 8  # 8 bits per group in an int64
# The launch (launch.py's table): the first pass (log-denominators) has one group per program and no V, so it
# wants more programs than the attention kernels (4 per SM measured fastest on the H200: benchmarks/dev/README.md).
# Without lse the denominator pass also stores the selected rows' scores (fp32 [B, T, columns, S_max]:
# 8.4 MB for the target's 1 query x 4 heads at B=16, 32K) so the probabilities need no second read of
# K (537 MB there). Above this size the scores are recomputed from K instead.
RAW_SCORES_MAX_BYTES = 512 * 2**20


@triton.jit(do_not_specialize=["kv_heads_packed", "group_sizes_packed"])
def _srh_lse_kernel(
    q_ptr, k_ptr, seqlens_ptr, lse_part_ptr, raw_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    batch, num_splits, s_max, kv_heads_packed, group_sizes_packed, qk_scale_log2,
    T: tl.constexpr, GROUP_ROWS: tl.constexpr, NUM_GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_RAW: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """Partial log-denominators over keys [split * chunk, ...) of [0, L_b + T), causal per row.

    WRITE_RAW: also store each selected row's scores (log2 units) on the context keys [0, L_b)
    to raw[b, t, column, j], so that the probabilities need no second read of K."""
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
    split = tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2)
    kv_head = (kv_heads_packed.to(tl.int64) >> (8 * g)) & 255
    group_size = (group_sizes_packed.to(tl.int64) >> (8 * g)) & 255

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t_row = offs_m // GROUP_ROWS
    sel = g * GROUP_ROWS + offs_m % GROUP_ROWS  # column of q_sel
    row_ok = (t_row < T) & (offs_m % GROUP_ROWS < group_size)
    q_off = b.to(tl.int64) * stride_qb + t_row * stride_qt + sel * stride_qh
    q = compute_q(tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0), k_ptr)

    seqlen = tl.load(seqlens_ptr + b)
    limit = seqlen + t_row
    n_keys = seqlen + T
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_keys)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head * stride_kh
    raw_rows = raw_ptr + (((b * T + t_row) * (NUM_GROUPS * GROUP_ROWS) + sel).to(tl.int64) * s_max)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(q.dtype)
        scores = tile_dot(q, tl.trans(k), DOT_MODE) * qk_scale_log2
        if WRITE_RAW:
            tl.store(raw_rows[:, None] + offs_n[None, :], scores,
                     mask=row_ok[:, None] & (offs_n[None, :] < seqlen))
        scores = tl.where(col_ok[None, :] & (offs_n[None, :] <= limit[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(scores - m_new[:, None]), 1)
        m_i = m_new
    # lse_part: [num_splits, B, T, NUM_GROUPS * GROUP_ROWS], natural log; empty chunks give -inf.
    part = ((split * batch + b) * T + t_row) * (NUM_GROUPS * GROUP_ROWS) + sel
    tl.store(lse_part_ptr + part, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=t_row < T)


@triton.jit(do_not_specialize=["group_sizes_packed"])
def _srh_sum_raw_kernel(
    raw_ptr, lse_part_ptr, seqlens_ptr, out_ptr,
    stride_ob, batch, num_splits, s_max, group_sizes_packed,
    T: tl.constexpr, GROUP_ROWS: tl.constexpr, NUM_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ACCUMULATE: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    """S[b, block] = sum over selected rows of exp2(raw - lse2), lse merged here from the split partials."""
    gdc_wait_if(USE_GDC)  # the raw scores and partials come from the previous kernel
    jb = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = jb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    seqlen = tl.load(seqlens_ptr + b)
    col_ok = offs_n < seqlen
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    columns: tl.constexpr = NUM_GROUPS * GROUP_ROWS
    if jb * BLOCK_N < seqlen:
        for r in range(T * columns):
            sel = r % columns
            group_size = (group_sizes_packed.to(tl.int64) >> (8 * (sel // GROUP_ROWS))) & 255
            if sel % GROUP_ROWS < group_size:
                # lse_part [num_splits, B, T, columns], natural log; merge with a max-shifted sum
                parts = tl.load(lse_part_ptr + (offs_s * batch + b) * (T * columns) + r, mask=offs_s < num_splits,
                                other=float("-inf")) * 1.4426950408889634
                top = tl.max(parts, 0)
                lse2 = top + tl.log2(tl.sum(tl.exp2(parts - top), 0))
                raw = tl.load(raw_ptr + (b * (T * columns) + r).to(tl.int64) * s_max + offs_n, mask=col_ok, other=0.0)
                total += tl.where(col_ok, tl.exp2(raw - lse2), 0.0)
    in_range = offs_n < s_max
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_n
    if ACCUMULATE:
        total += tl.load(out_ptrs, mask=in_range, other=0.0)
    tl.store(out_ptrs, total, mask=in_range)


@triton.jit(do_not_specialize=["kv_heads_packed", "group_sizes_packed"])
def _srh_score_kernel(
    q_ptr, lse_ptr, k_ptr, seqlens_ptr, out_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_lb, stride_lt, stride_lh,
    stride_kb, stride_kh, stride_ks,
    stride_ob, s_max, kv_heads_packed, group_sizes_packed, qk_scale_log2,
    T: tl.constexpr, GROUP_ROWS: tl.constexpr, NUM_GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """Column sums of exp(s - lse) over all selected rows for keys [jb * BLOCK_N, ...) of sequence b."""
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
    jb = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = jb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t_row = offs_m // GROUP_ROWS
    seqlen = tl.load(seqlens_ptr + b)
    col_ok = offs_n < seqlen
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    if jb * BLOCK_N < seqlen:
        for g in tl.static_range(NUM_GROUPS):
            kv_head = (kv_heads_packed.to(tl.int64) >> (8 * g)) & 255
            group_size = (group_sizes_packed.to(tl.int64) >> (8 * g)) & 255
            sel = g * GROUP_ROWS + offs_m % GROUP_ROWS
            row_ok = (t_row < T) & (offs_m % GROUP_ROWS < group_size)
            q_off = b.to(tl.int64) * stride_qb + t_row * stride_qt + sel * stride_qh
            q = compute_q(tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0), k_ptr)
            lse_off = b.to(tl.int64) * stride_lb + t_row * stride_lt + sel * stride_lh
            lse2 = tl.load(lse_ptr + lse_off, mask=row_ok, other=0.0) * 1.4426950408889634
            k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head * stride_kh
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            k = k.to(q.dtype)  # an fp8 cache is read as q's dtype
            scores = tile_dot(q, tl.trans(k), DOT_MODE) * qk_scale_log2
            probs = tl.exp2(scores - lse2[:, None])
            probs = tl.where(row_ok[:, None] & col_ok[None, :], probs, 0.0)
            total += tl.sum(probs, 0)
    in_range = offs_n < s_max
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_n
    if ACCUMULATE:
        total += tl.load(out_ptrs, mask=in_range, other=0.0)
    tl.store(out_ptrs, total, mask=in_range)


def _group_heads(head_ids: tuple[int, ...], group: int) -> list[tuple[int, list[int]]]:
    """[(kv_head, [query heads])] in first-appearance order of the KV heads."""
    groups: dict[int, list[int]] = {}
    for h in head_ids:
        groups.setdefault(h // group, []).append(h)
    return list(groups.items())


def _pack(values: list[int]) -> int:
    return sum(v << (8 * i) for i, v in enumerate(values))


def srh_score_forward(q, k_cache, cache_seqlens, head_ids, lse, softmax_scale, out, accumulate, *,
                      block_n=None, num_warps=None, num_stages=None, raw_scores=None, pdl=False):
    """Launch the SRH scoring kernels (inputs already validated).

    Launch contract:
      q:             [B, T, H_q, D], T <= 16, last dim contiguous, bf16 / fp16 / fp32
      k_cache:       [B, H_kv, S_max, D] q's dtype or float8_e4m3fn (plugins/kv_dtype.py), last dim contiguous,
                     any other strides
      cache_seqlens: int32 [B], L_b; the T new tokens' keys are at L_b .. L_b + T - 1
      head_ids:      static tuple of distinct query heads (H_kv <= 256)
      lse:           fp32 [B, T, H_q] natural-log denominators of the same queries, or None
      out:           fp32 [B, S_max], last dim contiguous; written (accumulate=False) or added to
      raw_scores:    without lse: True keeps the selected rows' scores (fp32 [B, T, columns, S_max],
                     written by the denominator pass) so K is read once; False reads K twice;
                     None picks True while that buffer stays under RAW_SCORES_MAX_BYTES
      pdl:           programmatic dependent launch of every kernel where pdl_supported (each waits for its
                     predecessor before its first read and signals the next launch only by exiting)
      block_n, num_warps, num_stages: the chosen launch (launch.py's table) when None; explicit values are
                     for the tests and the sweeps (benchmarks/dev/)
      Per launch of at most 8 KV-head groups (P = largest group, rows T * P per group):
        q_sel [B, T, n_groups * P, D] is gathered by torch ops.
        With lse: lse_sel is gathered too and _srh_score_kernel, grid (cdiv(S_max, BLOCK_N), B),
        loops over the groups, reads K once and writes (or adds) out[b, block].
        Without lse: _srh_lse_kernel, grid (splits, B, n_groups), writes partial log-denominators
        (and the raw scores); then _srh_sum_raw_kernel, grid (cdiv(S_max, BLOCK_N), B), merges the
        partials and sums exp(raw - lse) per key; or, raw_scores=False, torch.logsumexp merges them
        and _srh_score_kernel makes the second pass over K.
    """
    batch, t, heads_q, head_dim = q.shape
    heads_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    groups = _group_heads(head_ids, heads_q // heads_kv)
    qk_scale_log2 = softmax_scale * LOG2E
    mode = dot_mode(q.dtype)
    gdc = gdc_args(pdl and pdl_supported(q.device))
    choice = launch_table(q.device).srh_score
    if block_n is None:  # the H200 sweep's fastest: 64 keys at D = 128, 128 at D = 64 (benchmarks/dev/README.md)
        block_n = choice.wide_row_block_n if head_dim * q.element_size() >= 256 else choice.block_n
    num_warps = choice.num_warps if num_warps is None else num_warps
    num_stages = choice.num_stages if num_stages is None else num_stages
    for first in range(0, len(groups), MAX_GROUPS_PER_LAUNCH):
        chunk = groups[first:first + MAX_GROUPS_PER_LAUNCH]
        rows = max(len(heads) for _, heads in chunk)
        # Pad each group to `rows` heads by repeating its first head; the kernels mask the repeats.
        columns = [heads[i] if i < len(heads) else heads[0] for _, heads in chunk for i in range(rows)]
        q_sel = torch.stack([q[:, :, h] for h in columns], dim=2)  # [B, T, n_groups * rows, D]
        kv_packed = _pack([kv for kv, _ in chunk])
        sizes_packed = _pack([len(heads) for _, heads in chunk])
        block_m = max(16, triton.next_power_of_2(t * rows))
        add = accumulate or first > 0
        if lse is None:
            num_splits = pick_num_splits(batch * len(chunk), s_max, choice.min_keys_per_split, q.device,
                                         choice.lse_programs_per_sm)
            lse_part = torch.empty(num_splits, batch, t, len(columns), device=q.device, dtype=torch.float32)
            raw_bytes = 4 * batch * t * len(columns) * s_max
            keep_raw = raw_bytes <= RAW_SCORES_MAX_BYTES if raw_scores is None else raw_scores
            raw = (torch.empty(batch, t, len(columns), s_max, device=q.device, dtype=torch.float32) if keep_raw
                   else lse_part)  # unused without WRITE_RAW
            _srh_lse_kernel[(num_splits, batch, len(chunk))](
                q_sel, k_cache, cache_seqlens, lse_part, raw,
                q_sel.stride(0), q_sel.stride(1), q_sel.stride(2),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                batch, num_splits, s_max, kv_packed, sizes_packed, qk_scale_log2,
                T=t, GROUP_ROWS=rows, NUM_GROUPS=len(chunk), HEAD_DIM=head_dim,
                BLOCK_M=block_m, BLOCK_N=block_n, WRITE_RAW=keep_raw, DOT_MODE=mode,
                num_warps=num_warps, num_stages=num_stages, **gdc,
            )
            if keep_raw:
                _srh_sum_raw_kernel[(triton.cdiv(s_max, choice.sum_block_n), batch)](
                    raw, lse_part, cache_seqlens, out,
                    out.stride(0), batch, num_splits, s_max, sizes_packed,
                    T=t, GROUP_ROWS=rows, NUM_GROUPS=len(chunk), BLOCK_N=choice.sum_block_n,
                    BLOCK_S=max(2, triton.next_power_of_2(num_splits)), ACCUMULATE=add,
                    num_warps=choice.sum_num_warps, **gdc,
                )
                continue
            lse_sel = torch.logsumexp(lse_part, dim=0)  # [B, T, n_groups * rows]
        else:
            lse_sel = torch.stack([lse[:, :, h] for h in columns], dim=2)
        _srh_score_kernel[(triton.cdiv(s_max, block_n), batch)](
            q_sel, lse_sel, k_cache, cache_seqlens, out,
            q_sel.stride(0), q_sel.stride(1), q_sel.stride(2),
            lse_sel.stride(0), lse_sel.stride(1), lse_sel.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), s_max, kv_packed, sizes_packed, qk_scale_log2,
            T=t, GROUP_ROWS=rows, NUM_GROUPS=len(chunk), HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_N=block_n, ACCUMULATE=add, DOT_MODE=mode,
            num_warps=num_warps, num_stages=num_stages, **gdc,
        )


@torch.library.custom_op("trtllm_dustin::srh_score", mutates_args=("out",))
def _srh_score_op(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor, head_ids: list[int],
                  lse: torch.Tensor | None, softmax_scale: float, out: torch.Tensor, accumulate: bool,
                  pdl: bool) -> None:
    if runs_triton(q):
        srh_score_forward(q, k_cache, cache_seqlens, tuple(head_ids), lse, softmax_scale, out, accumulate, pdl=pdl)
    else:
        scores = srh_score_ref(q, k_cache, cache_seqlens, head_ids, lse, softmax_scale)
        if accumulate:
            out.add_(scores)
        else:
            out.copy_(scores)


@_srh_score_op.register_fake
def _(q, k_cache, cache_seqlens, head_ids, lse, softmax_scale, out, accumulate, pdl) -> None:
    return None


def srh_score(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor, head_ids: tuple[int, ...], *,
              lse: torch.Tensor | None = None, softmax_scale: float | None = None, out: torch.Tensor | None = None,
              accumulate: bool = False, pdl: bool = False) -> torch.Tensor:
    """Eq. 5 over the query heads `head_ids` of one layer: S fp32 [B, S_max].

    q [B, T, H_q, D] (queries at positions L_b + t); k_cache [B, H_kv, S_max, D]; cache_seqlens
    int32 [B]; head_ids static query-head indices. lse [B, T, H_q] fp32 from
    verify_attention(return_lse=True) on the same queries makes it one pass over K. With
    accumulate=True the scores are added into `out` (sum several layers into one S). pdl: launch with
    programmatic dependent launch where the device supports it (KernelConfig.pdl).
    """
    check_attention_inputs("srh_score", q, k_cache, None, cache_seqlens)
    batch, t, heads_q, head_dim = q.shape
    heads_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    head_ids = tuple(int(h) for h in head_ids)
    if not head_ids or len(set(head_ids)) != len(head_ids) or not all(0 <= h < heads_q for h in head_ids):
        raise ValueError(f"srh_score: head_ids {head_ids} must be distinct query heads in [0, {heads_q})")
    if heads_kv > 256:
        raise ValueError(f"srh_score: {heads_kv} KV heads exceed the kernel's 256; split the cache by heads")
    if lse is not None and (tuple(lse.shape) != (batch, t, heads_q) or lse.dtype != torch.float32):
        raise ValueError(f"srh_score: lse is {lse.dtype} {tuple(lse.shape)}; expected float32 "
                         f"[{batch}, {t}, {heads_q}] from verify_attention(..., return_lse=True)")
    if out is None:
        if accumulate:
            raise ValueError("srh_score: accumulate=True needs out= (the running sum to add into)")
        out = torch.empty(batch, s_max, device=q.device, dtype=torch.float32)
    else:
        check_out("srh_score", out, (batch, s_max), torch.float32, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    _srh_score_op(q, k_cache, cache_seqlens, list(head_ids), lse, float(scale), out, accumulate, pdl)
    return out
