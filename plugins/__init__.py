"""Kernels: Triton kernels, launchers, torch ops and plain-PyTorch references.

Public ops (also registered as torch.library ops in the `trtllm_dustin` namespace):
  verify_attention         full-cache decode / verify attention, optional lse
  prefill_attention        causal attention of a prompt chunk against the cache (flash style, any length)
  sparse_verify_attention  attention over selected cache entries + the new tokens (Sec. 4.1)
  srh_score                Semantic-Retrieval-Head importance scores (Eq. 5, Sec. 4.2)
  select_verify_indices    Eq. 6 verification set; streaming_indices: StreamingLLM set
On CUDA tensors the Triton kernels run; on CPU tensors too when TRITON_INTERPRET=1, otherwise
the references in reference.py. Which kernel paths run is data, `KernelConfig` (kernel_config.py),
which callers pass down: `pdl=` of the ops launches them with programmatic dependent launch on sm_90+
(pdl.py), and the skinny-M GEMM takes its tactic table from it (linear_tactics.py, tactics/).
"""

from .kernel_config import KernelConfig
from .prefill_attention import prefill_attention
from .selection import select_verify_indices, streaming_indices
from .sparse_verify_attention import sparse_verify_attention
from .split_kv import runs_triton
from .srh_score import srh_score
from .verify_attention import verify_attention

__all__ = [
    "KernelConfig",
    "prefill_attention",
    "runs_triton",
    "select_verify_indices",
    "sparse_verify_attention",
    "srh_score",
    "streaming_indices",
    "verify_attention",
]
