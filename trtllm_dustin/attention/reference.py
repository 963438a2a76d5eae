"""Plain-PyTorch attention backend: the readable reference, the CPU path, and the long-prefill path on GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from trtllm_dustin.plugins.kernel_config import KernelConfig

__all__ = ["ReferenceAttention", "full_attention_mask", "gather_sparse_kv"]


def full_attention_mask(cache_seqlens: torch.Tensor, num_new: int, num_keys: int) -> torch.Tensor:
    """bool [B, 1, T, S]: key j is visible to query t of sequence b iff j <= L_b + t."""
    j = torch.arange(num_keys, device=cache_seqlens.device)
    t = torch.arange(num_new, device=cache_seqlens.device)
    last = cache_seqlens.long()[:, None] + t[None, :]  # [B, T]
    return (j[None, None, :] <= last[:, :, None])[:, None]


def gather_sparse_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     indices: torch.Tensor, num_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys/values of I_b followed by the T new positions, and the visibility mask: [B, 1, T, K+T] for one set
    (indices [B, K]), [B, H_kv, T, K+T] for a set per KV head (indices [B, H_kv, K])."""
    B, H, _, D = k_cache.shape
    sets = indices if indices.dim() == 3 else indices[:, None].expand(B, H, -1)  # [B, H_kv, K]
    new_pos = cache_seqlens.long()[:, None] + torch.arange(num_new, device=k_cache.device)  # [B, T]
    positions = torch.cat([sets.long().clamp_min(0), new_pos[:, None].expand(B, H, num_new)], dim=2)  # [B, H, K+T]
    gather = positions[..., None].expand(B, H, -1, D)
    k = torch.gather(k_cache, 2, gather)  # [B, H_kv, K+T, D]
    v = torch.gather(v_cache, 2, gather)
    K = indices.shape[-1]
    t = torch.arange(num_new, device=k_cache.device)
    valid = indices >= 0 if indices.dim() == 3 else (indices >= 0)[:, None]  # [B, H_kv or 1, K]
    old_ok = valid[:, :, None, :].expand(-1, -1, num_new, K)  # [B, H_kv or 1, T, K]
    new_ok = (t[None, :] <= t[:, None])[None, None].expand(B, old_ok.shape[1], num_new, num_new)  # causal among new
    return k, v, torch.cat([old_ok, new_ok], dim=3)


class ReferenceAttention(AttentionBackend):
    """Masked scaled-dot-product attention over the cache (fp32 softmax inside SDPA's math)."""

    name = "reference"

    def __init__(self, kernels: KernelConfig | None = None) -> None:
        """`kernels` is taken for the registry's sake and ignored: this backend runs no kernels of its own."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        B, T, Hq, D = q.shape
        if meta.sparse:
            k, v, mask = gather_sparse_kv(k_cache, v_cache, meta.cache_seqlens, meta.indices, T)
        else:
            S = k_cache.shape[2] if meta.max_kv_len is None else min(meta.max_kv_len, k_cache.shape[2])
            k, v = k_cache[:, :, :S], v_cache[:, :, :S]
            mask = full_attention_mask(meta.cache_seqlens, T, S)
        k, v = k.to(q.dtype), v.to(q.dtype)  # a no-op unless the cache is fp8
        if mask.shape[1] > 1 and Hq != mask.shape[1]:  # a set per KV head: each query head takes its group's mask
            mask = mask.repeat_interleave(Hq // mask.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=Hq != k.shape[1])  # [B, H_q, T, D]
        return out.transpose(1, 2)
