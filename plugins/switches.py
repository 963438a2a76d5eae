"""Environment switches that turn a kernel path off, for A/B runs (each defaults to on; "0" turns it off).

  TRTLLM_DUSTIN_PDL             programmatic dependent launch of the Triton kernels (pdl.py)
  TRTLLM_DUSTIN_SKINNY_LINEAR   the skinny-M GEMM for decode-sized projections (skinny_linear.py)
  TRTLLM_DUSTIN_SKINNY_PDL      its PDL launch
  TRTLLM_DUSTIN_SKINNY_TIES     its shapes that tied with cuBLAS (taken on PDL launches only)
  TRTLLM_DUSTIN_ROUND_KERNELS   the row argmax and the round commit (argmax.py, commit.py)
"""

import os

__all__ = ["switched_on"]


def switched_on(name: str) -> bool:
    """False only when the environment sets `name` to "0"."""
    return os.environ.get(name, "1") != "0"
