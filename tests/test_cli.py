"""The command line end to end on a random-weight preset, and EOS / max-token stops."""

from __future__ import annotations

import torch
from conftest import vanilla_decoder

from trtllm_dustin.cli import main
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.sampling import SamplingParams


def test_generate_prints_tokens_and_timings(capsys) -> None:
    code = main(["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "9", "--batch-size", "2",
                 "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("[0] [") == 1 and out.count("[1] [") == 1
    assert "generated 12 tokens" in out and "prefill" in out and "tokens/s" in out


def test_eos_stops_a_sequence_and_others_continue() -> None:
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=1).model
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    cache = KVCache.allocate(model.config, 2, 64, torch.float64, "cpu")
    free_run = vanilla_decoder(model, cache).generate(
        prompts, GenerationConfig(max_new_tokens=12)).tokens
    eos = free_run[0][4]  # make the 5th token of sequence 0 an end-of-sequence token
    stopped = vanilla_decoder(model, cache).generate(
        prompts, GenerationConfig(max_new_tokens=12, eos_token_ids=(eos,), sync_every=3)).tokens
    first = free_run[0].index(eos)
    assert stopped[0] == free_run[0][: first + 1]
    if eos in free_run[1]:
        assert stopped[1] == free_run[1][: free_run[1].index(eos) + 1]
    else:
        assert stopped[1] == free_run[1]


def test_sampled_generation_is_reproducible_with_a_seed() -> None:
    model = load_model("preset:tiny-qwen", seed=2).model
    cache = KVCache.allocate(model.config, 2, 40, torch.float32, "cpu")
    decoder = vanilla_decoder(model, cache)
    config = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(1.0, 0.95, seed=11))
    a = decoder.generate([[1, 2, 3], [4, 5]], config).tokens
    b = decoder.generate([[1, 2, 3], [4, 5]], config).tokens
    assert a == b and all(len(t) == 16 for t in a)


def test_classic_with_no_model_arguments_runs_the_packaged_pair_on_a_long_text(capsys) -> None:
    code = main(["generate", "--method", "classic", "--max-new-tokens", "12", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "prompt: the first 1536 tokens of" in out and "validation split" in out
    assert "prompt 1536 tokens, generated" in out
    tau = float(out.split("mean accepted length tau ")[1].split()[0].rstrip(","))
    assert 1.0 <= tau <= 4.0  # Γ = 3: between 1 and Γ + 1 tokens per round
