"""Our decoder against `transformers` on the same weights: logits in fp32 and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_hf_model, vanilla_decoder

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [11, 12], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 1]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="200KB")  # several shards + an index
    assert (path / "model.safetensors.index.json").is_file()
    return hf, path


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def both_logits(checkpoint, prompt: list[int], device: torch.device, dtype: torch.dtype):
    """(ours, transformers') logits [T, V] of one prompt, ours loaded from the saved checkpoint in `dtype`."""
    hf, path = checkpoint
    model = load_model(str(path), device=device, dtype=dtype).model
    tokens = torch.tensor(prompt)[None]
    with torch.no_grad():
        expected = hf(tokens).logits[0]
    cache = KVCache.allocate(model.config, 1, 64, dtype, device)
    with torch.inference_mode():
        got = model(tokens.to(device), cache, AttentionMetadata(cache.seqlens), get_backend("reference"))[0].cpu()
    return got, expected


def test_logits_match_transformers(checkpoint, device: torch.device) -> None:
    got, expected = both_logits(checkpoint, PROMPTS[0], device, torch.float32)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers_generate(checkpoint, device: torch.device) -> None:
    hf, path = checkpoint
    model = load_model(str(path), device=device, dtype=torch.float32).model
    cache = KVCache.allocate(model.config, len(PROMPTS), 64, torch.float32, device)
    decoder = vanilla_decoder(model, cache)
    result = decoder.generate(PROMPTS, GenerationConfig(max_new_tokens=32, prefill_chunk=5))
    for prompt, got in zip(PROMPTS, result.tokens, strict=True):
        assert got == hf_greedy(hf, prompt, 32)


def test_bf16_logits_close_to_fp32(checkpoint, device: torch.device) -> None:
    """The serving dtype: bf16 logits stay within a stated tolerance of the fp32 reference."""
    got, expected = both_logits(checkpoint, PROMPTS[2], device, torch.bfloat16)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 0.05 * scale  # bf16 has 8 mantissa bits over 3 layers


def test_ragged_batch_equals_each_sequence_alone(device: torch.device) -> None:
    model = load_model("preset:tiny-llama", device=device, dtype=torch.float64, seed=3).model
    config = GenerationConfig(max_new_tokens=20, prefill_chunk=4, sampling=SamplingParams())
    batch_cache = KVCache.allocate(model.config, 4, 64, torch.float64, device)
    together = vanilla_decoder(model, batch_cache).generate(PROMPTS, config).tokens
    for prompt, expected in zip(PROMPTS, together, strict=True):
        cache = KVCache.allocate(model.config, 1, 64, torch.float64, device)
        alone = vanilla_decoder(model, cache).generate([prompt], config).tokens[0]
        assert alone == expected
    assert len({tuple(t) for t in together}) == len(PROMPTS)  # the prompts really lead to different outputs
