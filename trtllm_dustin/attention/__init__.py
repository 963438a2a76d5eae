"""Attention backends behind one interface, chosen by name from a registry."""

from __future__ import annotations

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata
from trtllm_dustin.attention.reference import ReferenceAttention
from trtllm_dustin.attention.triton import TritonAttention

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {ReferenceAttention.name: ReferenceAttention,
                                               TritonAttention.name: TritonAttention}


def get_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend: "reference" (PyTorch) or "triton" (the plugins' kernels)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]()
