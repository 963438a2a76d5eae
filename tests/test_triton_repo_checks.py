"""triton-repo checks what `generate` checks when it writes a repository (models, device, limits, drafters, Dustin
config), with the same defaults for the default model, and stores paths that work from any directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trtllm_dustin.cli import main
from trtllm_dustin.models import load_model
from trtllm_dustin.models.loading import save_hf_checkpoint
from trtllm_dustin.serving import ServingConfig

TINY = ["--model", "preset:tiny-llama", "--max-batch", "2", "--max-seq-len", "64"]


def written(repo: Path) -> ServingConfig:
    return ServingConfig.load(repo / "dustin" / "1" / "serving_config.json")


@pytest.mark.parametrize("extra, message", [
    (["--model", "/nowhere/model"], "--model /nowhere/model does not exist; pass a checkpoint directory"),
    (["--model", "preset:tiny-llama", "--max-seq-len", "100000"], "--max-seq-len 100000 exceeds the target's 2048"),
    (["--model", "preset:tiny-llama", "--method", "classic"], r"methods \['classic'\] need a draft model"),
    (["--model", "preset:tiny-llama", "--method", "vanilla", "dustin-h", "--draft", "preset:tiny-llama-draft"],
     r"methods \['dustin-h'\] need --dustin-config"),
    (["--model", "preset:tiny-llama", "--method", "longspark"], "need --longspark DIR"),
    (["--model", "preset:tiny-llama", "--method", "dustin-ip-ring"], "need --ring DIR"),
    (["--model", "preset:tiny-llama", "--max-batch", "100000", "--max-seq-len", "2048"], "needs .* GiB but only"),
])
def test_a_repository_that_cannot_serve_is_refused(tmp_path: Path, capsys, extra, message) -> None:
    assert main(["triton-repo", "--out", str(tmp_path / "repo"), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "repo").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys) -> None:
    assert main(["triton-repo", "--out", str(tmp_path / "repo"), *TINY, "--device", "cuda"]) == 2
    assert "--device cuda but no CUDA device is visible here" in capsys.readouterr().err


def test_relative_paths_are_stored_absolute(tmp_path: Path, monkeypatch, capsys) -> None:
    """A --draft given relative to the current directory still names the checkpoint when the server starts
    elsewhere; the last line says how to serve the repository."""
    draft = load_model("preset:tiny-llama-draft", seed=1).model
    save_hf_checkpoint(draft, tmp_path / "ckpt" / "draft")
    monkeypatch.chdir(tmp_path)
    assert main(["triton-repo", "--out", "repo", *TINY, "--method", "classic", "--draft", "ckpt/draft"]) == 0
    config = written(tmp_path / "repo")
    assert config.draft == str((tmp_path / "ckpt" / "draft").resolve()) and config.model == "preset:tiny-llama"
    assert f"trtllm-dustin serve --repo {(tmp_path / 'repo').resolve()}" in capsys.readouterr().out


def test_the_draft_choices_are_recorded(tmp_path: Path) -> None:
    """--draft-kv-cache and --draft-weights reach the repository's serving config (default: the draft as loaded)."""
    served = [*TINY, "--method", "classic", "--draft", "preset:tiny-llama-draft"]
    assert main(["triton-repo", "--out", str(tmp_path / "plain"), *served]) == 0
    assert (written(tmp_path / "plain").draft_kv_cache, written(tmp_path / "plain").draft_weights) == ("model", "model")
    assert main(["triton-repo", "--out", str(tmp_path / "repo"), *served, "--draft-kv-cache", "fp8",
                 "--draft-weights", "int8"]) == 0
    assert (written(tmp_path / "repo").draft_kv_cache, written(tmp_path / "repo").draft_weights) == ("fp8", "int8")


def test_the_default_model_takes_its_packaged_pair(tmp_path: Path, smollm2) -> None:
    """As generate does: the packaged draft, its searched Dustin config and the packaged LongSpark and ring
    drafters."""
    assert main(["triton-repo", "--out", str(tmp_path / "repo"), "--method", "dustin-h", "dustin-t-longspark",
                 "dustin-ip-ring", "--max-seq-len", "1024"]) == 0
    config = written(tmp_path / "repo")
    assert config.draft == "smollm2-draft" and config.dustin is not None and config.dustin.budget == 2048
    assert config.longspark == "smollm2-longspark" and config.ring == "smollm2-ring"
