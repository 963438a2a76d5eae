"""Prefill attention: causal attention of a chunk of new tokens against the cache (flash-attention style).

Query token t of sequence b sits at position L_b + t and attends to cache positions [0, L_b + t], like
verify_attention, but for prompt chunks of any length: a program owns BLOCK_M consecutive query tokens of one
query head and walks the key blocks once with the online softmax, so the work is compute-bound (tensor cores) and
the score matrix is never materialised. Keys every row of the block sees (j <= L_b + first row) run without a mask;
only the last BLOCK_M + BLOCK_N keys, the causal diagonal, are masked. Rows t >= query_lens[b] are padding of a
ragged batch: they are written as zeros and cost nothing. The new tokens' K/V are already in the cache.
"""

import math

import torch
import triton
import triton.language as tl

from .checks import check_attention_inputs, check_out
from .kv_dtype import compute_q
from .launch import launch_table
from .reference import prefill_attention_ref
from .split_kv import LOG2E, NEG_BIG, dot_mode, runs_triton, tile_dot

__all__ = ["prefill_attention", "prefill_attention_forward"]


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_base, v_base, stride_ks, stride_vs, n0, limit, offs_d, qk_scale_log2,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_MODE: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) of the online softmax. MASKED: keys past each row's limit (L_b + t) are
    hidden and not loaded; otherwise every key of the block is visible to every row."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n <= tl.max(limit, 0)
    # K is loaded as its transpose [D, BLOCK_N] for the q @ K^T dot (faster on the H200 than rows + tl.trans)
    if MASKED:
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=col_ok[None, :], other=0.0)
    else:
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None])
    if MASKED:
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    else:
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
    scores = tile_dot(q, kt.to(q.dtype), DOT_MODE)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        scores = tl.where(offs_n[None, :] <= limit[:, None], scores, float("-inf"))
    # the softmax scale (log2 units) folded into the max and the exponent: one FMA per score
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale_log2)
    p = tl.exp2(scores * qk_scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(q.dtype), v.to(q.dtype), DOT_MODE)
    return acc, m_new, l_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, qlens_ptr, out_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh,
    num_heads, num_m_blocks, T, qk_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_QLENS: tl.constexpr, DOT_MODE: tl.constexpr,
):
    # The last query blocks see the most keys: they go first, so the short ones fill the tail of the launch.
    m_block = num_m_blocks - 1 - tl.program_id(0)
    pair = tl.program_id(1)
    b = pair // num_heads
    head = pair % num_heads
    kv_head = head // GROUP

    m0 = m_block * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_len = T
    if HAS_QLENS:
        q_len = tl.minimum(tl.load(qlens_ptr + b), T)
    row_ok = offs_m < q_len
    out_off = b.to(tl.int64) * stride_ob + offs_m.to(tl.int64) * stride_ot + head * stride_oh
    out_ptrs = out_ptr + out_off[:, None] + offs_d[None, :]
    if m0 >= q_len:  # padding rows of a shorter sequence: zeros, no key is read
        tl.store(out_ptrs, tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=offs_m[:, None] < T)
        return

    q_off = b.to(tl.int64) * stride_qb + offs_m.to(tl.int64) * stride_qt + head * stride_qh
    q = compute_q(tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0), k_ptr)
    seqlen = tl.load(seqlens_ptr + b)
    # The last key each row sees; a padding row inside the block sees as far as the last real row (it is not stored).
    limit = seqlen + tl.minimum(offs_m, q_len - 1)

    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys [0, full_end) are visible to every row of the block: L_b + m0 is the first row's last key.
    full_end = ((seqlen + m0 + 1) // BLOCK_N) * BLOCK_N
    for n0 in tl.range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, stride_ks, stride_vs, n0, limit, offs_d,
                                      qk_scale_log2, BLOCK_N, False, DOT_MODE)
    end = seqlen + tl.minimum(m0 + BLOCK_M, q_len)  # one past the last real row's last key
    for n0 in tl.range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, stride_ks, stride_vs, n0, limit, offs_d,
                                      qk_scale_log2, BLOCK_N, True, DOT_MODE)
    o = acc / l_i[:, None]
    o = tl.where(row_ok[:, None], o, 0.0)
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < T)


def prefill_attention_forward(q, k_cache, v_cache, cache_seqlens, query_lens, softmax_scale, out, *,
                              block_m=None, block_n=None, num_warps=None, num_stages=None):
    """Launch the prefill attention kernel (inputs already validated).

    Launch contract:
      q:             [B, T, H_q, D], any T >= 1, last dim contiguous, bf16 / fp16 / fp32
      k_cache, v_cache: [B, H_kv, S_max, D] same dtype (q's, or float8_e4m3fn: read as fp16 for a bf16 q),
                     last dim contiguous, any other strides; H_q = G * H_kv (query head h reads KV head h // G)
      cache_seqlens: int32 [B], L_b; positions L_b .. L_b + q_len_b - 1 already hold the new tokens, L_b + q_len_b
                     <= S_max (the caller's, not checked: it would need the values on the host)
      query_lens:    int32 [B] or None: real query tokens per sequence, q_len_b = min(query_lens[b], T); None: T
      out:           [B, T, H_q, D] q.dtype, last dim contiguous (written everywhere; padding rows are zeros)
      grid:          (cdiv(T, BLOCK_M), B * H_q); a program owns query rows [m0, m0 + BLOCK_M) of one (b, head)
      block_m, block_n, num_warps, num_stages: the chosen launch (launch.py's table) when None; explicit values
                     are for the tests and the sweeps (benchmarks/dev/bench_prefill_attention.py)
    """
    batch, t, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    group = heads_q // heads_kv
    # The chosen launch: 128 x 128 tiles, 8 warps, 3 stages, the H200 sweep's fastest at Llama-3.1-8B heads
    # (benchmarks/dev/README.md). Small tiles in the interpreter, whose cost is per element.
    # fp32 (the tests' dtype) takes 64 x 32 tiles in 2 stages: 128 x 128 fp32 tiles exceed the shared memory.
    choice = launch_table(q.device).prefill_attention
    wide = q.element_size() <= 2
    if block_m is None:
        block_m = (choice.block_m if wide else choice.fp32_block_m) if q.is_cuda else choice.interpreter_block
    if block_n is None:
        block_n = (choice.block_n if wide else choice.fp32_block_n) if q.is_cuda else choice.interpreter_block
    if num_warps is None:
        num_warps = choice.num_warps if block_m >= choice.block_m else choice.fp32_num_warps
    if num_stages is None:
        num_stages = choice.num_stages if wide else choice.fp32_num_stages
    num_m_blocks = triton.cdiv(t, block_m)
    qlens = query_lens if query_lens is not None else cache_seqlens  # unused without HAS_QLENS
    _prefill_attention_kernel[(num_m_blocks, batch * heads_q)](
        q, k_cache, v_cache, cache_seqlens, qlens, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads_q, num_m_blocks, t, softmax_scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_QLENS=query_lens is not None, DOT_MODE=dot_mode(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )


@torch.library.custom_op("trtllm_dustin::prefill_attention", mutates_args=("out",))
def _prefill_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                          query_lens: torch.Tensor | None, softmax_scale: float, out: torch.Tensor) -> None:
    if runs_triton(q):
        prefill_attention_forward(q, k_cache, v_cache, cache_seqlens, query_lens, softmax_scale, out)
    else:
        out.copy_(prefill_attention_ref(q, k_cache, v_cache, cache_seqlens, query_lens, softmax_scale))


@_prefill_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, query_lens, softmax_scale, out) -> None:
    return None


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                      query_lens: torch.Tensor | None = None, *, softmax_scale: float | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk against the cache: query t of sequence b sees positions [0, L_b + t].

    q [B, T, H_q, D]; k_cache, v_cache [B, H_kv, S_max, D] (q's dtype, or float8_e4m3fn); cache_seqlens int32 [B]
    (each sequence's length before the chunk, whose K/V are already in the cache); query_lens int32 [B] (optional):
    the chunk's real tokens per sequence, rows past them are padding and come back as zeros. Returns
    out [B, T, H_q, D] in q.dtype.
    """
    check_attention_inputs("prefill_attention", q, k_cache, v_cache, cache_seqlens, max_tokens=None)
    batch = q.shape[0]
    if query_lens is not None and (query_lens.shape != (batch,) or query_lens.dtype != torch.int32
                                   or query_lens.device != q.device):
        raise ValueError(f"prefill_attention: query_lens is {query_lens.dtype} {tuple(query_lens.shape)} on "
                         f"{query_lens.device}; expected int32 [{batch}] on {q.device} (real tokens per sequence)")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out("prefill_attention", out, q.shape, q.dtype, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _prefill_attention_op(q, k_cache, v_cache, cache_seqlens, query_lens, float(scale), out)
    return out
