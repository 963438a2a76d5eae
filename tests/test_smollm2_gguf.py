"""The embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF): our loader against transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch
from helpers.models import vanilla_decoder

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.loading import default_gguf_path
from trtllm_dustin.runtime.generation import GenerationConfig

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def pair(smollm2):
    path = default_gguf_path()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf, smollm2


def test_smollm2_logits_and_greedy_tokens_match_transformers(pair) -> None:
    hf, ours = pair
    assert ours.model.config.num_layers == 30 and ours.model.config.num_kv_heads == 3
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    cache = KVCache.allocate(ours.model.config, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        got = ours.model(torch.tensor([ids]), cache, AttentionMetadata(cache.seqlens), get_backend("reference"))[0]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)

    n = 24
    want = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):]
    cache = KVCache.allocate(ours.model.config, 1, 64, torch.float32, "cpu")
    result = vanilla_decoder(ours.model, cache).generate(
        [ids], GenerationConfig(max_new_tokens=n))
    assert result.tokens[0] == want.tolist()
    assert "Paris" in ours.tokenizer.decode(result.tokens[0])
