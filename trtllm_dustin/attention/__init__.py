"""Attention backends behind one interface, chosen by name from a registry."""

from __future__ import annotations

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata
from trtllm_dustin.attention.reference import ReferenceAttention

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {ReferenceAttention.name: ReferenceAttention}


def get_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend ("reference"; "triton" once the kernels are importable)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]()
