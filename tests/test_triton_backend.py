"""The Triton attention backend decodes exactly what the reference backend decodes."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import vanilla_decoder

from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.generation import GenerationConfig

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen"])
def test_triton_backend_greedy_tokens_equal_reference(preset: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(f"preset:{preset}", device=device, dtype=torch.float32, seed=4).model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43, 44]]
    config = GenerationConfig(max_new_tokens=10, prefill_chunk=4)
    outputs = {}
    for name in ("reference", "triton"):
        cache = KVCache.allocate(model.config, 3, 32, torch.float32, device)
        outputs[name] = vanilla_decoder(model, cache, name, use_cuda_graph=False).generate(
            prompts, config).tokens
    assert outputs["triton"] == outputs["reference"]
