"""Plain-PyTorch references of the kernels: the CPU path, the tests' oracle and the benchmarks' check.

They compute in float32 (float64 when given float64 inputs), materialise the full score matrix
and are written for clarity, not speed. Shapes and semantics are those of the kernel ops.
"""

import math

import torch

__all__ = [
    "prefill_attention_ref",
    "sparse_verify_attention_ref",
    "srh_score_ref",
    "verify_attention_ref",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _causal_limit(cache_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """[B, T]: the last cache position query token t may see (it sits at L_b + t)."""
    return cache_seqlens.long()[:, None] + torch.arange(t, device=cache_seqlens.device)[None, :]


def _masked_attention(q, k_cache, v_cache, allowed, softmax_scale):
    """q [B, T, H_q, D]; caches [B, H_kv, S, D]; allowed bool [B, T, S] (or [B, T, H_kv, S]: per KV head)
    -> out [B, T, H_q, D], lse [B, T, H_q]."""
    batch, t, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    group = heads_q // heads_kv
    cd = _compute_dtype(q.dtype)
    qg = q.to(cd).reshape(batch, t, heads_kv, group, head_dim)  # [B, T, H_kv, G, D]
    scores = torch.einsum("btkgd,bksd->btkgs", qg, k_cache.to(cd)) * softmax_scale
    mask = allowed[:, :, :, None, :] if allowed.dim() == 4 else allowed[:, :, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, T, H_kv, G]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("btkgs,bksd->btkgd", probs, v_cache.to(cd))
    return out.reshape(batch, t, heads_q, head_dim), lse.reshape(batch, t, heads_q)


def _causal_allowed(cache_seqlens: torch.Tensor, t: int, s_max: int) -> torch.Tensor:
    positions = torch.arange(s_max, device=cache_seqlens.device)
    return positions[None, None, :] <= _causal_limit(cache_seqlens, t)[:, :, None]  # [B, T, S]


def verify_attention_ref(q, k_cache, v_cache, cache_seqlens, softmax_scale=None, return_lse=False):
    """Query t of sequence b attends to cache positions [0, L_b + t]."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    allowed = _causal_allowed(cache_seqlens, q.shape[1], k_cache.shape[2])
    out, lse = _masked_attention(q, k_cache, v_cache, allowed, scale)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


def prefill_attention_ref(q, k_cache, v_cache, cache_seqlens, query_lens=None, softmax_scale=None):
    """verify_attention_ref for a chunk of any length; rows t >= query_lens[b] (padding) are zeros."""
    out = verify_attention_ref(q, k_cache, v_cache, cache_seqlens, softmax_scale)
    if query_lens is None:
        return out
    real = torch.arange(q.shape[1], device=q.device)[None, :] < query_lens.long()[:, None]  # [B, T]
    return out * real[:, :, None, None].to(out.dtype)


def sparse_verify_attention_ref(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale=None):
    """Query t attends to {indices[b, i] >= 0} plus the new tokens L_b .. L_b + t; indices [B, K] (one set for every
    head) or [B, H_kv, K] (a set per KV head)."""
    batch, t = q.shape[:2]
    heads_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sets = indices if indices.dim() == 3 else indices[:, None]  # [B, H_kv or 1, K]
    selected = torch.zeros(batch, sets.shape[1], s_max + 1, dtype=torch.bool, device=q.device)
    slots = torch.where(sets >= 0, sets.long(), s_max)  # padding lands in the spare column
    selected.scatter_(2, slots, True)
    positions = torch.arange(s_max, device=q.device)
    limit = _causal_limit(cache_seqlens, t)  # [B, T]
    new_tokens = (positions[None, None, :] >= cache_seqlens.long()[:, None, None]) & (
        positions[None, None, :] <= limit[:, :, None])  # [B, T, S]
    allowed = selected[:, None, :, :s_max] | new_tokens[:, :, None, :]  # [B, T, H_kv or 1, S]
    allowed = allowed.expand(batch, t, heads_kv, s_max) if indices.dim() == 3 else allowed[:, :, 0]
    out, _ = _masked_attention(q, k_cache, v_cache, allowed, scale)
    return out.to(q.dtype)


def srh_score_ref(q, k_cache, cache_seqlens, head_ids, lse=None, softmax_scale=None):
    """Eq. 5 over the heads `head_ids`: S[b, j] = sum_h sum_t p(b, t, h, j) for j < L_b, else 0.

    p is normalised over the causal range [0, L_b + t]; with `lse` [B, T, H_q] given it is used as
    the log-denominator instead (as the kernel does).
    """
    batch, t, heads_q, head_dim = q.shape
    heads_kv, s_max = k_cache.shape[1], k_cache.shape[2]
    group = heads_q // heads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    cd = _compute_dtype(q.dtype)
    heads = torch.tensor(list(head_ids), device=q.device)
    qs = q.to(cd)[:, :, heads]  # [B, T, n, D]
    ks = k_cache.to(cd)[:, heads // group]  # [B, n, S, D]
    scores = torch.einsum("btnd,bnsd->btns", qs, ks) * scale
    allowed = _causal_allowed(cache_seqlens, t, s_max)[:, :, None, :]  # [B, T, 1, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    log_denominator = torch.logsumexp(scores, dim=-1) if lse is None else lse.to(cd)[:, :, heads]
    probs = torch.exp(scores - log_denominator[..., None])
    context = torch.arange(s_max, device=q.device)[None, :] < cache_seqlens.long()[:, None]  # [B, S]
    return (probs.sum(dim=(1, 2)) * context).float()
