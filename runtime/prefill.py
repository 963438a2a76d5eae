"""Chunked prefill of ragged prompts into consecutive slots of a static cache.

All prompts start at position 0 and advance together chunk by chunk (`PrefillJob`), so activation memory is
bounded by the chunk; a shorter prompt's padding writes K/V past its length, which nothing reads and decoding
overwrites (the attention backend skips padding rows it is told of: AttentionMetadata.query_lens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer

__all__ = ["PrefillJob", "prefill", "prefill_chunk_for", "slot_range"]

# Rows one prefill forward takes at most over the whole batch: 8K tokens per sequence ran closer to the attention +
# GEMM bound than 2K on the H200 (benchmarks/dev/README.md); a 32K-row chunk's FFN activations take about 2 GB at
# Llama-3.1-8B's width.
CHUNK_ROWS = 32768
MAX_CHUNK = 8192


def prefill_chunk_for(batch: int) -> int:
    """Prompt tokens per sequence per prefill forward for `batch` prompts: 8K, fewer past 4 sequences."""
    return max(512, min(MAX_CHUNK, CHUNK_ROWS // max(batch, 1)))


def slot_range(cache: KVCache, slots: slice) -> KVCache:
    """The cache restricted to the consecutive slots [start, stop) (views: writes land in the shared buffers)."""
    start, stop, step = slots.indices(cache.batch_slots)
    if step != 1 or stop <= start:
        raise ValueError(f"slots {slots} must be a non-empty run of consecutive batch slots")
    if (start, stop) == (0, cache.batch_slots):
        return cache
    return KVCache(cache.k[:, start:stop], cache.v[:, start:stop], cache.seqlens[start:stop])


class PrefillJob:
    """Prompts written into a cache's slots chunk by chunk: `step()` runs the next chunk, `run()` all of them.

    The in-flight batcher interleaves one job's chunks with the other slots' decode rounds. Between chunks the
    job's slots are parked at length done + 1 (done: prompt tokens written so far): a round writes the target's K/V
    at L_b .. L_b + Γ and a model drafter's at L_b - 1 .. L_b + Γ - 1, all at positions >= done, which the next chunk
    writes again before anything reads them; the prompt's finished part stays as the chunks wrote it.
    """

    @torch.inference_mode()
    def __init__(self, model: Transformer, cache: KVCache, backend: AttentionBackend,
                 prompts: Sequence[Sequence[int]], chunk: int = 2048, capture_layers: Sequence[int] = (),
                 hidden_out: dict[int, torch.Tensor] | None = None, start: int = 0) -> None:
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("prefill needs at least one prompt and no empty one")
        if chunk < 1:
            raise ValueError(f"prefill chunk {chunk} must be >= 1")
        if not 0 <= start < min(len(p) for p in prompts):
            raise ValueError(f"prefill start {start} must leave at least the last prompt token to run "
                             f"(0 <= start < {min(len(p) for p in prompts)})")
        B = len(prompts)
        if B > cache.batch_slots:
            raise ValueError(f"{B} prompts for {cache.batch_slots} cache slots")
        self.model, self.backend, self.chunk = model, backend, chunk
        self.capture_layers, self.hidden_out = tuple(capture_layers), hidden_out or {}
        device, config = cache.seqlens.device, model.config
        self.lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
        self.longest = max(len(p) for p in prompts)
        self.tokens = torch.zeros(B, self.longest, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.view = cache if B == cache.batch_slots else slot_range(cache, slice(0, B))
        # Prompt positions written so far (the same for every prompt: they advance together). start > 0: the caller
        # has put the prompts' first `start` positions into the cache already (a reused prefix: prefix_cache.py).
        self.done = start
        self.last_logits = torch.zeros(B, config.vocab_size, dtype=torch.float32, device=device)
        self.qdtype = model.embed.weight.dtype  # the model's: the cache may be fp8
        self.last_queries = {layer: torch.zeros(B, config.num_heads, config.head_dim, dtype=self.qdtype,
                                                device=device) for layer in self.capture_layers}
        self.view.seqlens.fill_(self.done + 1)  # parked until the first chunk

    @property
    def finished(self) -> bool:
        return self.done >= self.longest

    @property
    def remaining(self) -> int:
        """Prompt positions (of the longest prompt) still to write."""
        return self.longest - self.done

    @torch.inference_mode()
    def step(self) -> bool:
        """Write the next chunk; return whether the prompts are complete (their seqlens then set to their lengths)."""
        if self.finished:
            raise RuntimeError("this prefill has no chunk left")
        model, view, lens, config = self.model, self.view, self.lens, self.model.config
        B, device = self.tokens.shape[0], self.tokens.device
        start, end = self.done, min(self.done + self.chunk, self.longest)
        view.seqlens.fill_(start)
        real = (lens - start).clamp(0, end - start).to(torch.int32)  # [B]: a shorter prompt's chunk is padded
        meta = AttentionMetadata(cache_seqlens=view.seqlens, max_kv_len=end, query_lens=real)
        in_chunk = (lens - 1 - start).clamp(0, end - start - 1)  # [B]: each prompt's last token in this chunk
        capture = None
        if self.capture_layers or self.hidden_out:
            capture = QueryCapture(self.capture_layers, {
                layer: torch.empty(B, end - start, config.num_heads, config.head_dim, dtype=self.qdtype,
                                   device=device) for layer in self.capture_layers},
                {layer: torch.empty(B, end - start, config.hidden_size, dtype=self.qdtype, device=device)
                 for layer in self.hidden_out})
        logits = model(self.tokens[:, start:end], view, meta, self.backend, logit_index=in_chunk, capture=capture)
        ends_here = ((lens - 1) >= start) & ((lens - 1) < end)  # [B]
        self.last_logits = torch.where(ends_here[:, None], logits, self.last_logits)
        if capture is not None:
            rows = torch.arange(B, device=device)
            for layer, q in capture.queries.items():
                self.last_queries[layer] = torch.where(ends_here[:, None, None], q[rows, in_chunk],
                                                       self.last_queries[layer])
            for layer, h in capture.hidden.items():
                self.hidden_out[layer].copy_(torch.where(ends_here[:, None], h[rows, in_chunk],
                                                         self.hidden_out[layer]))
        self.done = end
        if self.finished:
            view.seqlens.copy_(lens)
        else:
            view.seqlens.fill_(self.done + 1)  # parked between chunks (the class docstring says why)
        return self.finished

    def run(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every remaining chunk; the last tokens' logits [B, V] and captured queries {layer: [B, H_q, D]}."""
        while not self.finished:
            self.step()
        return self.last_logits, self.last_queries


def prefill(model: Transformer, cache: KVCache, backend: AttentionBackend, prompts: Sequence[Sequence[int]],
            chunk: int = 2048, capture_layers: Sequence[int] = (), hidden_out: dict[int, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Write the prompts' K/V into the cache's slots 0 .. B-1 (pass a `slot_range` view for others), set their
    seqlens to the prompt lengths, return the last token's logits [B, V].

    For each layer in `capture_layers` also return the last prompt token's rotated queries [B, H_q, D]
    (Dustin's first target-history signal, paper Sec. 4.2.3). hidden_out: layer -> [B, H] buffers, filled with
    the last prompt token's hidden state (the block's output) at each of those layers (LongSpark's boundary state).
    """
    return PrefillJob(model, cache, backend, prompts, chunk, capture_layers, hidden_out).run()
