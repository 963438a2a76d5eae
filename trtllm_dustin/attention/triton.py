"""Attention backend over the Triton kernels of `trtllm_dustin.plugins`.

Steps of up to MAX_KERNEL_TOKENS new tokens per sequence (decode, verification of Γ+1 tokens) run the
split-KV kernels; longer forwards (prompt chunks) run the flash-style prefill kernel, which skips the
padding rows of a ragged chunk (`meta.query_lens`). On CPU tensors without Triton's interpreter the
chunks take the PyTorch reference backend (SDPA, the CPU path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata
from trtllm_dustin.attention.reference import ReferenceAttention

if TYPE_CHECKING:
    from trtllm_dustin.plugins.kernel_config import KernelConfig

__all__ = ["MAX_KERNEL_TOKENS", "TritonAttention"]

MAX_KERNEL_TOKENS = 16


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, kernels: KernelConfig | None = None) -> None:
        from trtllm_dustin import plugins  # imported here: Triton must be importable only when this backend is used

        self._ops = plugins
        self.kernels = plugins.KernelConfig() if kernels is None else kernels
        self._fallback = ReferenceAttention()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if q.shape[1] > MAX_KERNEL_TOKENS:
            if meta.sparse or not self._ops.runs_triton(q):
                return self._fallback.attend(q, k_cache, v_cache, meta)
            return self._ops.prefill_attention(q, k_cache, v_cache, meta.cache_seqlens, meta.query_lens)
        pdl = self.kernels.pdl
        if meta.sparse:
            return self._ops.sparse_verify_attention(q, k_cache, v_cache, meta.cache_seqlens, meta.indices, pdl=pdl)
        return self._ops.verify_attention(q, k_cache, v_cache, meta.cache_seqlens, pdl=pdl)
