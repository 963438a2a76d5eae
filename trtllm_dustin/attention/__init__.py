"""Attention backends behind one interface, chosen by name from a registry; and the training mode of the forward
(whole sequences with autograd, whole_sequence.py), which a trainer builds itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trtllm_dustin.attention.interface import AttentionBackend, AttentionMetadata, InPassSelection
from trtllm_dustin.attention.reference import ReferenceAttention
from trtllm_dustin.attention.triton import TritonAttention
from trtllm_dustin.attention.whole_sequence import WholeSequenceAttention, WholeSequenceKV

if TYPE_CHECKING:
    from trtllm_dustin.plugins.kernel_config import KernelConfig

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "InPassSelection", "WholeSequenceAttention",
           "WholeSequenceKV", "get_backend"]

BACKENDS: dict[str, type[AttentionBackend]] = {ReferenceAttention.name: ReferenceAttention,
                                               TritonAttention.name: TritonAttention}


def get_backend(name: str, kernels: KernelConfig | None = None) -> AttentionBackend:
    """Instantiate a registered backend: "reference" (PyTorch) or "triton" (the plugins' kernels, launched as
    `kernels` says; None: KernelConfig())."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](kernels)
