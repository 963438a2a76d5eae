"""What the kernel tests share: where they run and how close a kernel must come to its float64 reference."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                  reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# CPU tensors reach a Triton kernel only where the interpreter was chosen at import (conftest: no GPU).
needs_interpreter = pytest.mark.skipif(HAS_CUDA or not INTERPRET,
                                       reason="Triton's interpreter runs only on machines without a GPU here")
# ||out - ref|| / ||ref|| and max |out - ref| / max |ref| per dtype (attention outputs).
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 6e-2)}


def use_interpreter(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """CPU tensors take the Triton kernels (in the interpreter) or, off, the plugins' PyTorch references: in this
    process (plugins.split_kv.INTERPRET, read once at import) and in the processes it starts (TRITON_INTERPRET).
    Turning it on helps only where the interpreter was chosen at import (conftest: no GPU)."""
    from trtllm_dustin.plugins import split_kv

    monkeypatch.setenv("TRITON_INTERPRET", "1" if on else "0")
    monkeypatch.setattr(split_kv, "INTERPRET", on)


def write_tactics(path, entries: list[dict], gpu: str = "test", weights: str | None = None) -> str:
    """A skinny-GEMM tactic table file (plugins/linear_tactics.py) holding `entries`, of `weights` ("int8": an int8
    table; None: no "weights" field, a bf16 table); returns its path."""
    import json

    table = {"schema_version": 1, "gpu": gpu, "entries": entries} | ({} if weights is None else {"weights": weights})
    path.write_text(json.dumps(table))
    return str(path)
