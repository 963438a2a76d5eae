"""The attention seam: what a decoder layer hands to an attention backend, and what it gets back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Protocol

import torch

__all__ = ["AttentionBackend", "AttentionMetadata", "InPassSelection"]


class InPassSelection(Protocol):
    """Selection inside the verification pass (selection layers, runtime/selectors/in_pass.py).

    The layers in `dense_layers` attend to the full cache. At each layer of `selection_layers` the pass first
    `choose`s: from that layer's queries it rewrites, in place, the set `AttentionMetadata.indices` that this layer and
    the following ones read (the layers before it read the set as the round began: the previous round's choice).
    """

    dense_layers: frozenset[int]
    selection_layers: frozenset[int]

    def choose(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        """q [B, T, H_q, D]: this layer's queries of the T verified tokens (at L_b + t); k_cache [B, H_kv, S_max, D]
        with their keys written. Rewrites the set that `indices` holds (no host sync: it runs in a captured pass)."""

    def rows(self, rows: slice) -> InPassSelection:
        """The same selection over the batch slots [start, stop) only (a forward over those slots: the CPU verifies
        its busy slots alone)."""


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs shared by all layers.

    Tensors here keep their storage across CUDA-graph replays: update them in place.
    """

    cache_seqlens: torch.Tensor  # int32 [B]: committed length L_b; the T new tokens sit at L_b .. L_b+T-1
    indices: torch.Tensor | None = None  # int32 [B, K]: sparse verification set I in [0, L_b), -1 = padding; or
    # [B, H_kv, K]: a set per KV head (evaluation: per-KV-head sets, runtime/experimental/oracle.py, dustin.py)
    max_kv_len: int | None = None  # host-known bound on L_b + T (eager prefill only): lets backends read less
    # int32 [B]: the real new tokens of each sequence in a ragged prefill chunk (rows past them are padding, their
    # outputs unspecified); None: all T
    query_lens: torch.Tensor | None = None
    in_pass: InPassSelection | None = None  # selection inside this forward: `indices` is rewritten at its layers

    @property
    def sparse(self) -> bool:
        return self.indices is not None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with: the full cache when an in-pass selection makes it dense."""
        if self.in_pass is not None and layer in self.in_pass.dense_layers:
            return replace(self, indices=None, in_pass=None)
        return self


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
