"""Bad input gets a clear error that names the value and the fix, raised before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import tiny_hf_model

from trtllm_dustin.cli import main
from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.kv_cache import KVCache, MemoryPlanError
from trtllm_dustin.models import ModelLoadError, get_preset, load_model


@pytest.fixture()
def checkpoint(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path, max_shard_size="200KB")
    return tmp_path


def test_unknown_architecture(checkpoint) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        load_model(str(checkpoint))


def test_missing_shard(checkpoint) -> None:
    shards = sorted(checkpoint.glob("*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(checkpoint))


def test_corrupt_shard(checkpoint) -> None:
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(str(checkpoint))


def test_shape_mismatch_names_the_tensor(checkpoint) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 128
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mlp.gate_proj.weight has shape"):
        load_model(str(checkpoint))


def test_no_weights(tmp_path) -> None:
    tiny_hf_model("qwen2").config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_unknown_preset_and_path() -> None:
    with pytest.raises(ValueError, match="preset 'nope' is unknown"):
        load_model("preset:nope")
    with pytest.raises(ModelLoadError, match="neither a preset"):
        load_model("/no/such/model")


def test_cache_that_does_not_fit_is_refused_before_allocating() -> None:
    config = get_preset("llama-3.3-70b")
    with pytest.raises(MemoryPlanError, match="lower --batch-size or --max-seq-len"):
        KVCache.allocate(config, 1024, 131072, torch.bfloat16, "cpu")


def test_weights_that_do_not_fit_are_refused() -> None:
    with pytest.raises(MemoryPlanError, match="weights of qwen2.5-72b"):
        load_model("preset:qwen2.5-72b", dtype=torch.float32)


def test_bad_config_values() -> None:
    with pytest.raises(ConfigError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)


def test_cli_prompt_longer_than_max_seq_len(capsys) -> None:
    code = main(["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "40", "--max-seq-len", "32",
                 "--max-new-tokens", "4"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--max-seq-len 32 is smaller than prompt 0 (40 tokens)" in err and "raise --max-seq-len" in err


def test_cli_text_prompt_without_tokenizer(capsys) -> None:
    assert main(["generate", "--model", "preset:tiny-llama", "--prompt", "hello"]) == 2
    assert "--prompt-tokens" in capsys.readouterr().err


def test_cli_checks_the_configs_before_loading_weights(capsys) -> None:
    """A Dustin config searched for another pair, a LongSpark drafter trained for another target and a cache longer
    than the model's positions are refused from the configs alone: no weight is read first."""
    from trtllm_dustin.models.longspark import default_longspark_path
    from trtllm_dustin.models.packaged import default_dustin_config_path

    tiny = ["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "5"]
    cases = [(["--method", "dustin-h", "--draft", "preset:tiny-llama-draft", "--dustin-config",
               str(default_dustin_config_path())], "searched for another target model than tiny-llama"),
             (["--method", "longspark", "--longspark", str(default_longspark_path())],
              "LongSpark target layers [3, 9, 15, 22, 29] do not exist in tiny-llama"),
             (["--max-new-tokens", "3000"], "the prompt (5 tokens) + --max-new-tokens 3000 = 3005 exceeds the "
              "target's 2048 positions (tiny-llama); shorten the prompt or lower --max-new-tokens")]
    for extra, message in cases:
        assert main(tiny + extra) == 2
        captured = capsys.readouterr()
        assert message in captured.err and "weights loaded" not in captured.out


def test_triton_repo_names_its_own_flags_when_the_model_does_not_fit(tmp_path, monkeypatch, capsys) -> None:
    """triton-repo's limits are --max-batch / --max-seq-len / --method (it has no --batch-size): its refusal names
    those, before anything is written."""
    from trtllm_dustin import cli, kv_cache

    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 1 << 20)
    out = tmp_path / "models"
    code = cli.main(["triton-repo", "--out", str(out), "--model", "preset:tiny-llama", "--draft",
                     "preset:tiny-llama-draft", "--method", "classic", "vanilla", "--max-batch", "4",
                     "--max-seq-len", "256", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert ("lower --max-batch, --max-seq-len or --prefix-cache-mib, or serve fewer --method, or use a larger "
            "device") in err
    assert "--batch-size" not in err
    assert not out.exists()


def test_cuda_memory_counts_the_allocators_cached_blocks_as_free(monkeypatch) -> None:
    """Blocks torch's caching allocator keeps after a tensor is freed are reusable: available_memory adds them to what
    the driver reports free, so freeing one batch's caches before the next does not shrink the plan's budget."""
    import torch

    from trtllm_dustin import kv_cache

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 << 30)
    assert kv_cache.available_memory(torch.device("cuda")) == (3 + 10 - 4) << 30
    kv_cache.check_fits("a cache", 8 << 30, torch.device("cuda"))  # 8 GiB <= 90 % of 9 GiB
    with pytest.raises(kv_cache.MemoryPlanError, match="needs 8.50 GiB but only 9.00 GiB is free"):
        kv_cache.check_fits("a cache", int(8.5 * 2**30), torch.device("cuda"))
