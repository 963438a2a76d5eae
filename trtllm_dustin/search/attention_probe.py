"""Per-head attention probabilities of chosen layers, recomputed from captured queries and cached keys.

Optimised attention never writes its probabilities out, so the offline search recomputes them: one forward writes
every layer's rotated keys into the static cache and copies the chosen positions' rotated queries out
(`QueryCapture`); then `head_attention` turns one layer's queries and keys into probabilities. Callers walk the
layers one at a time and reduce each to what they keep (a needle mass, a head-summed score map), so probabilities
of all layers are never held at once: at 8K context one layer is [n, H, 8192] floats, thirty would not fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.runtime.prefill import prefill

__all__ = ["CapturedForward", "capture_queries", "head_attention"]


def head_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, query_positions: torch.Tensor,
                   heads: Sequence[int] | None = None, softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention probabilities of each query over the cache, per query head.

    q: rotated queries [B, T, H_q, D] of the tokens at `query_positions` (int [B, T]); k_cache_layer: the layer's
    rotated keys [B, H_kv, S, D]. Query head h reads KV head h // (H_q / H_kv). Query (b, t) attends to keys
    [0, query_positions[b, t]] with scale 1/sqrt(D), exactly as the model's forward did.
    Returns fp32 [B, T, n, S] for the n heads in `heads` (all H_q when None); zero past each query's position.
    """
    B, T, Hq, D = q.shape
    Hkv, S = k_cache_layer.shape[1], k_cache_layer.shape[2]
    if k_cache_layer.shape[0] != B or k_cache_layer.shape[3] != D or Hq % Hkv:
        raise ValueError(f"head_attention: q {tuple(q.shape)} does not match keys {tuple(k_cache_layer.shape)} "
                         "([B, H_q, D] vs [B, H_kv, S, D] with H_q a multiple of H_kv)")
    if query_positions.shape != (B, T):
        raise ValueError(f"head_attention: query_positions {tuple(query_positions.shape)} must be [B={B}, T={T}]")
    if int(query_positions.max()) >= S:
        raise ValueError(f"head_attention: a query sits at position {int(query_positions.max())} but the cache holds "
                         f"{S}; capture queries of cached tokens only")
    head_ids = list(range(Hq)) if heads is None else [int(h) for h in heads]
    if not head_ids or min(head_ids) < 0 or max(head_ids) >= Hq:
        raise ValueError(f"head_attention: heads {head_ids} must be non-empty and within [0, {Hq})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    index = torch.tensor(head_ids, device=q.device)
    qs = q.float()[:, :, index]  # [B, T, n, D]
    ks = k_cache_layer.float()[:, index // (Hq // Hkv)]  # [B, n, S, D]
    scores = torch.einsum("btnd,bnsd->btns", qs, ks) * scale  # [B, T, n, S]
    visible = torch.arange(S, device=q.device)[None, None, :] <= query_positions.long()[:, :, None]  # [B, T, S]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


@dataclass
class CapturedForward:
    """A teacher-forced forward over token windows: the cache holds every position's keys, `queries` the last n."""

    cache: KVCache  # keys/values of tokens [0, N) of each row
    queries: dict[int, torch.Tensor]  # layer -> rotated queries [B, n, H_q, D] of positions N-n .. N-1
    positions: torch.Tensor  # int64 [B, n]: the positions of those queries
    logits: torch.Tensor | None  # fp32 [B, n, V] at those positions, when asked for

    def attention(self, layer: int, heads: Sequence[int] | None = None) -> torch.Tensor:
        """fp32 [B, n, len(heads), N]: the captured queries' probabilities in `layer` (see head_attention)."""
        if layer not in self.queries:
            raise KeyError(f"layer {layer} was not captured (captured: {sorted(self.queries)})")
        return head_attention(self.queries[layer], self.cache.k[layer], self.positions, heads)


@torch.inference_mode()
def capture_queries(model: Transformer, backend: AttentionBackend, tokens: torch.Tensor, layers: Sequence[int],
                    last: int, chunk: int = 1024, keep_logits: bool = False) -> CapturedForward:
    """Run `tokens` [B, N] through the model (no sampling: teacher forcing) and keep the last `last` positions'
    rotated queries of `layers`.

    The first N - last tokens go through chunked prefill; the last `last` in one forward that copies their queries
    out, so the queries are exactly those of a decode or verify step at those positions.
    """
    B, N = tokens.shape
    if not 1 <= last <= N - 1:
        raise ValueError(f"capture_queries: last={last} must lie in [1, N-1={N - 1}] (N = {N} tokens per row)")
    config = model.config
    bad = [layer for layer in layers if not 0 <= layer < config.num_layers]
    if bad:
        raise ValueError(f"capture_queries: layers {bad} do not exist ({config.name} has {config.num_layers})")
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    cache = KVCache.allocate(config, B, N, dtype, device)
    prefill(model, cache, backend, [row.tolist() for row in tokens[:, : N - last]], chunk=chunk)
    buffers = {layer: torch.empty(B, last, config.num_heads, config.head_dim, dtype=dtype, device=device)
               for layer in layers}
    meta = AttentionMetadata(cache_seqlens=cache.seqlens, max_kv_len=N)
    logits = model(tokens[:, N - last:].to(device), cache, meta, backend, capture=QueryCapture(tuple(layers), buffers))
    cache.seqlens.add_(last)
    positions = torch.arange(N - last, N, device=device)[None, :].expand(B, last)
    return CapturedForward(cache, buffers, positions, logits if keep_logits else None)
