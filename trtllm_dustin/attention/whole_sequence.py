"""Attention over whole sequences from position 0, with autograd: the training mode of the one forward.

`Transformer.forward_train` (draft distillation) and the LongSpark trainer's target features run the inference
forward (`Transformer.run_layers`, module path) over these two instead of a static cache and a cache backend:

    WholeSequenceKV          the "cache": each layer's keys and values as the forward computed them, kept as tensors
                             (no preallocated buffer, no in-place write, so gradients flow through them)
    WholeSequenceAttention   causal attention of the T tokens over that layer's T keys (query t sees keys 0..t)

Both assume what a training window is: every sequence starts at position 0 and the forward sees all T tokens at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata

__all__ = ["WholeSequenceAttention", "WholeSequenceKV"]


class WholeSequenceKV:
    """Per layer the K/V of one forward over whole sequences, as KVCache's `write` / `layer` seam (the forward writes
    them, the backend reads them back): [B, H_kv, T, D] each, the forward's own tensors."""

    def __init__(self, batch: int, device: torch.device | str) -> None:
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)  # every sequence starts at position 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def write(self, index: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """k_new, v_new [B, T, H_kv, D] of the tokens at positions 0..T-1 (`positions`, as the forward passes them)."""
        self.k[index], self.v[index] = k_new.transpose(1, 2), v_new.transpose(1, 2)  # [B, H_kv, T, D]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]


class WholeSequenceAttention(AttentionBackend):
    """Causal scaled-dot-product attention over a WholeSequenceKV layer (SDPA's causal kernels; no mask tensor)."""

    name = "whole-sequence"

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q [B, T, H_q, D], k_cache / v_cache [B, H_kv, T, D] -> out [B, T, H_q, D]."""
        if meta.sparse:
            raise ValueError("whole-sequence attention verifies no sparse set; pass metadata without indices")
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, is_causal=True,
                                             enable_gqa=q.shape[2] != k_cache.shape[1])  # [B, H_q, T, D]
        return out.transpose(1, 2)
