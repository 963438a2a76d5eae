"""Full-cache decode / verify attention (the vanilla decoder at T = 1, full-cache verification at T > 1).

Query token t of sequence b sits at position L_b + t and attends to cache positions [0, L_b + t]:
the whole committed context plus the new tokens up to itself (causal among the new ones). The
caller has already written the T new tokens' K/V at L_b .. L_b + T - 1.

Memory-bound: one program serves all G query heads of a KV head and all T tokens from one read
of each K/V byte (a [T * G, BLOCK_N] score tile through tl.dot), and split-KV fills the SMs.
"""

import math

import torch
import triton
import triton.language as tl

from .checks import check_attention_inputs, check_out
from .kv_dtype import compute_q, is_fp8
from .launch import launch_table
from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_supported
from .reference import verify_attention_ref
from .split_kv import (
    LOG2E,
    NEG_BIG,
    combine_splits,
    dot_mode,
    online_softmax_update,
    pick_num_splits,
    runs_triton,
    store_split_result,
    tile_dot,
)

__all__ = ["verify_attention", "verify_attention_forward"]


@triton.jit
def _verify_attention_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh,
    batch, num_kv_heads, num_splits, qk_scale_log2,
    T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT_OUTPUT: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    split = tl.program_id(0)
    pair = tl.program_id(1)
    b = pair // num_kv_heads
    kv_head = pair % num_kv_heads
    num_heads = num_kv_heads * GROUP

    # Tile rows r = t * GROUP + g: token t, query head kv_head * GROUP + g.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t_row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = t_row < T
    q_off = b.to(tl.int64) * stride_qb + t_row * stride_qt + head * stride_qh
    gdc_wait_if(USE_GDC)  # PDL: nothing is read before the previous kernel has completed
    q = compute_q(tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0), k_ptr)

    seqlen = tl.load(seqlens_ptr + b)
    limit = seqlen + t_row  # last position each row may see
    n_keys = seqlen + T
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_keys)

    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(q.dtype)
        scores = tile_dot(q, tl.trans(k), DOT_MODE) * qk_scale_log2
        visible = col_ok[None, :] & (offs_n[None, :] <= limit[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(scores, m_i, l_i, acc, v, DOT_MODE)
    gdc_launch_if(USE_GDC)

    store_split_result(acc, m_i, l_i, out_ptr, lse_ptr, o_part_ptr, ml_part_ptr, b, t_row, head, row_ok, offs_d,
                       split, num_splits, batch, T, num_heads, stride_ob, stride_ot, stride_oh, HEAD_DIM, DIRECT_OUTPUT)


def verify_attention_forward(q, k_cache, v_cache, cache_seqlens, softmax_scale, out, lse, *,
                             max_seqlen=None, num_splits=None, block_n=None, num_warps=None, num_stages=None,
                             pdl=False):
    """Launch the full-cache verify attention kernel (inputs already validated).

    Launch contract:
      q:             [B, T, H_q, D], T <= 16, last dim contiguous, bf16 / fp16 / fp32
      k_cache, v_cache: [B, H_kv, S_max, D] same dtype (q's, or float8_e4m3fn: read as fp16 for a bf16 q),
                     last dim contiguous, any other strides
      cache_seqlens: int32 [B], L_b; positions L_b .. L_b + T - 1 already hold the new tokens
      out:           [B, T, H_q, D] q.dtype, last dim contiguous (written)
      lse:           fp32 [B, T, H_q] contiguous (written, natural log, scale included)
      grid:          (num_splits, B * H_kv); a program owns the [T * G, D] tile of one (b, kv head)
                     and keys [split * chunk, (split + 1) * chunk) of [0, L_b + T), chunk from L_b
                     in-kernel; num_splits > 1 adds the combine_splits launch.
      max_seqlen:    static bound on L_b + T used to pick num_splits (default S_max)
      pdl:           programmatic dependent launch where pdl_supported
      num_splits, block_n, num_warps, num_stages: the chosen launch (launch.py's table) when None; explicit values
                     are for the tests and the sweeps (benchmarks/dev/)
    """
    batch, t, heads_q, head_dim = q.shape
    heads_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    group = heads_q // heads_kv
    choice = launch_table(q.device).verify_attention
    # An fp8 cache's tile conversion leaves one program per SM short of the bandwidth: two per SM (benchmarks/dev/).
    fp8 = is_fp8(k_cache.dtype)
    if num_splits is None:
        bound = s_max if max_seqlen is None else min(max_seqlen, s_max)
        num_splits = pick_num_splits(batch * heads_kv, bound, choice.min_keys_per_split, q.device,
                                     programs_per_sm=choice.fp8_programs_per_sm if fp8 else 1)
    block_m = max(16, triton.next_power_of_2(t * group))
    if block_n is None:  # a K tile of tile_bytes (32 KB: 128 keys at D=128 in bf16): 3 stages of K + V fit in smem
        block_n = min(choice.max_block_n, choice.tile_bytes // (head_dim * q.element_size())
                      // (2 if block_m >= 128 else 1))
    if num_warps is None:  # the H200 sweeps' fastest: 4 warps, 8 for 256-key tiles over a bf16 cache
        wide = block_m >= 128 or (block_n >= choice.max_block_n and not fp8)
        num_warps = choice.wide_num_warps if wide else choice.num_warps
    if num_stages is None:
        num_stages = choice.num_stages
    direct = num_splits == 1
    use_gdc = pdl and pdl_supported(q.device)
    if direct:
        o_part = ml_part = out  # unused
    else:
        o_part = torch.empty(num_splits, batch, t, heads_q, head_dim, device=q.device, dtype=torch.float32)
        ml_part = torch.empty(2, num_splits, batch, t, heads_q, device=q.device, dtype=torch.float32)
    _verify_attention_kernel[(num_splits, batch * heads_kv)](
        q, k_cache, v_cache, cache_seqlens, out, lse, o_part, ml_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        batch, heads_kv, num_splits, softmax_scale * LOG2E,
        T=t, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT_OUTPUT=direct, DOT_MODE=dot_mode(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **gdc_args(use_gdc),
    )
    if not direct:
        combine_splits(o_part, ml_part, out, lse, pdl=use_gdc)


@torch.library.custom_op("trtllm_dustin::verify_attention", mutates_args=("out", "lse"))
def _verify_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                         softmax_scale: float, max_seqlen: int, out: torch.Tensor, lse: torch.Tensor,
                         pdl: bool) -> None:
    if runs_triton(q):
        verify_attention_forward(q, k_cache, v_cache, cache_seqlens, softmax_scale, out, lse,
                                 max_seqlen=max_seqlen if max_seqlen > 0 else None, pdl=pdl)
    else:
        ref_out, ref_lse = verify_attention_ref(q, k_cache, v_cache, cache_seqlens, softmax_scale, return_lse=True)
        out.copy_(ref_out)
        lse.copy_(ref_lse)


@_verify_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, softmax_scale, max_seqlen, out, lse, pdl) -> None:
    return None


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                     softmax_scale: float | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
                     max_seqlen: int | None = None,
                     pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Full-cache attention of T new tokens: query t of sequence b sees cache positions [0, L_b + t].

    q [B, T, H_q, D]; k_cache, v_cache [B, H_kv, S_max, D]; cache_seqlens int32 [B] (length before
    the new tokens, whose K/V are already in the cache). Returns out [B, T, H_q, D] in q.dtype, and
    with return_lse also lse fp32 [B, T, H_q] (natural log of the softmax denominator, scale
    included). max_seqlen: optional static bound on L_b + T, used only to size the split-KV grid. pdl: launch with
    programmatic dependent launch where the device supports it (KernelConfig.pdl).
    """
    check_attention_inputs("verify_attention", q, k_cache, v_cache, cache_seqlens)
    batch, t, heads_q, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out("verify_attention", out, q.shape, q.dtype, q.device)
    if max_seqlen is not None and max_seqlen < t:
        raise ValueError(f"verify_attention: max_seqlen {max_seqlen} is smaller than the {t} new tokens; "
                         "pass an upper bound on L_b + T")
    lse = torch.empty(batch, t, heads_q, device=q.device, dtype=torch.float32)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    _verify_attention_op(q, k_cache, v_cache, cache_seqlens, float(scale), max_seqlen or 0, out, lse, pdl)
    return (out, lse) if return_lse else out
