"""The attention seam: what a decoder layer hands to an attention backend, and what it gets back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

__all__ = ["AttentionBackend", "AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs shared by all layers.

    Tensors here keep their storage across CUDA-graph replays: update them in place.
    """

    cache_seqlens: torch.Tensor  # int32 [B]: committed length L_b; the T new tokens sit at L_b .. L_b+T-1
    indices: torch.Tensor | None = None  # int32 [B, K]: sparse verification set I in [0, L_b), -1 = padding; or
    # [B, H_kv, K]: a set per KV head (evaluation: per-KV-head sets, runtime/selectors/oracle.py, dustin.py)
    # int32 [L, B, K] or [L, B, H_kv, K]: a set per decoder layer, which the model gives each layer as its `indices`
    # (evaluation only: the per-layer oracle); None: `indices` for every layer
    layer_indices: torch.Tensor | None = None
    max_kv_len: int | None = None  # host-known bound on L_b + T (eager prefill only): lets backends read less
    # int32 [B]: the real new tokens of each sequence in a ragged prefill chunk (rows past them are padding, their
    # outputs unspecified); None: all T
    query_lens: torch.Tensor | None = None

    @property
    def sparse(self) -> bool:
        return self.indices is not None or self.layer_indices is not None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with: its own set when there is one per layer."""
        if self.layer_indices is None:
            return self
        return replace(self, indices=self.layer_indices[layer], layer_indices=None)


class AttentionBackend(ABC):
    """Causal attention of T new query tokens over a sequence's cached context.

    Full mode: query t of sequence b attends to cache positions [0, L_b + t].
    Sparse mode: query t attends to {I_b} ∪ [L_b, L_b + t] (Dustin's verification, paper Sec. 4.1).
    The new tokens' K/V are already in the cache when `attend` is called. A backend is built with the process's
    KernelConfig (or None for the defaults): `get_backend(name, kernels)` calls `Backend(kernels)`.
    """

    name: str = "abstract"

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q [B, T, H_q, D], k_cache/v_cache [B, H_kv, S_max, D] -> out [B, T, H_q, D] in q's dtype."""
