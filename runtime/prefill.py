"""Chunked prefill of ragged prompts into consecutive slots of a static cache.

All prompts start at position 0 and advance together chunk by chunk, so activation memory is bounded
by the chunk; a shorter prompt's padding writes K/V past its length, which nothing reads and decoding
overwrites (the attention backend skips padding rows it is told of: AttentionMetadata.query_lens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer

__all__ = ["prefill", "slot_range"]


def slot_range(cache: KVCache, slots: slice) -> KVCache:
    """The cache restricted to the consecutive slots [start, stop) (views: writes land in the shared buffers)."""
    start, stop, step = slots.indices(cache.batch_slots)
    if step != 1 or stop <= start:
        raise ValueError(f"slots {slots} must be a non-empty run of consecutive batch slots")
    if (start, stop) == (0, cache.batch_slots):
        return cache
    return KVCache(cache.k[:, start:stop], cache.v[:, start:stop], cache.seqlens[start:stop])


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, backend: AttentionBackend, prompts: Sequence[Sequence[int]],
            chunk: int = 2048, capture_layers: Sequence[int] = (), hidden_out: dict[int, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Write the prompts' K/V into the cache's slots 0 .. B-1 (pass a `slot_range` view for others), set their
    seqlens to the prompt lengths, return the last token's logits [B, V].

    For each layer in `capture_layers` also return the last prompt token's rotated queries [B, H_q, D]
    (Dustin's first target-history signal, paper Sec. 4.2.3). hidden_out: layer -> [B, H] buffers, filled with
    the last prompt token's hidden state (the block's output) at each of those layers (LongSpark's boundary state).
    """
    device = cache.seqlens.device
    B = len(prompts)
    config = model.config
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(B, longest, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    if B > cache.batch_slots:
        raise ValueError(f"{B} prompts for {cache.batch_slots} cache slots")
    view = cache if B == cache.batch_slots else slot_range(cache, slice(0, B))
    view.seqlens.zero_()
    last_logits = torch.zeros(B, config.vocab_size, dtype=torch.float32, device=device)
    qdtype = model.embed.weight.dtype  # the model's: the cache may be fp8
    last_queries = {layer: torch.zeros(B, config.num_heads, config.head_dim, dtype=qdtype, device=device)
                    for layer in capture_layers}
    for start in range(0, longest, chunk):
        end = min(start + chunk, longest)
        real = (lens - start).clamp(0, end - start).to(torch.int32)  # [B]: a shorter prompt's chunk is padded
        meta = AttentionMetadata(cache_seqlens=view.seqlens, max_kv_len=end, query_lens=real)
        in_chunk = (lens - 1 - start).clamp(0, end - start - 1)  # [B]: each prompt's last token in this chunk
        capture = None
        if capture_layers or hidden_out:
            capture = QueryCapture(tuple(capture_layers), {
                layer: torch.empty(B, end - start, config.num_heads, config.head_dim, dtype=qdtype,
                                   device=device) for layer in capture_layers},
                {layer: torch.empty(B, end - start, config.hidden_size, dtype=qdtype, device=device)
                 for layer in (hidden_out or {})})
        logits = model(tokens[:, start:end], view, meta, backend, logit_index=in_chunk, capture=capture)
        ends_here = ((lens - 1) >= start) & ((lens - 1) < end)  # [B]
        last_logits = torch.where(ends_here[:, None], logits, last_logits)
        if capture is not None:
            rows = torch.arange(B, device=device)
            for layer, q in capture.queries.items():
                last_queries[layer] = torch.where(ends_here[:, None, None], q[rows, in_chunk], last_queries[layer])
            for layer, h in capture.hidden.items():
                hidden_out[layer].copy_(torch.where(ends_here[:, None], h[rows, in_chunk], hidden_out[layer]))
        view.seqlens.add_(end - start)
    view.seqlens.copy_(lens)
    return last_logits, last_queries
