"""Engines built with --pp-size > 1 run pipeline-parallel: `trtllm-dustin generate --engine` under torchrun's
environment gives the pp=1 engine's tokens (rank 0 prints, the other ranks are silent); each rank opens, checks and
loads only its own shard; ranks with different engines, a process count other than the engine's stages, and a run
without torchrun are refused with the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.engines import DUSTIN, LIMITS, build
from helpers.pipeline import free_port, rank_env

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.build_engines.engine import EngineError, open_engine
from trtllm_dustin.cli import main
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.pipeline import PipelineStage

RUN = ["generate", "--prompt-tokens", "30", "--max-new-tokens", "12", "--method", "dustin-h", "--device", "cpu",
       "--batch-size", "2", "--seed", "3", "--temperature", "0.8", "--top-p", "0.9"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp-engines")
    common = dict(longspark=None, ring=None, dustin=DUSTIN, limits=LIMITS)
    return {"pp1": build(root / "pp1", **common), "pp2": build(root / "pp2", pp_size=2, **common),
            "pp2-other": build(root / "pp2-other", pp_size=2, seed=4, **common),
            "pp2-first1": build(root / "pp2-first1", pp_size=2, first_stage_layers=1, **common)}


def cli_ranks(argvs: list[list[str]], timeout_s: float = 240.0) -> list[subprocess.CompletedProcess]:
    """`python -m trtllm_dustin.cli ARGV` on each rank, in torchrun's environment (what torchrun gives each process)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "trtllm_dustin.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ | rank_env(rank, len(argvs), port))
             for rank, argv in enumerate(argvs)]
    done = []
    for proc, argv in zip(procs, argvs, strict=True):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done


def token_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[")]


@pytest.mark.usefixtures("plugin_references")
def test_a_pp2_engine_on_two_processes_generates_what_the_pp1_engine_does(engines, capsys) -> None:
    """dustin-h with seeded sampling: the generator state crosses the stages, S_target comes from rank 0's layer."""
    assert main([*RUN, "--engine", str(engines["pp1"])]) == 0
    expected = token_lines(capsys.readouterr().out)
    ranks = cli_ranks([[*RUN, "--engine", str(engines["pp2"])]] * 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert expected and token_lines(ranks[0].stdout) == expected
    assert "pipeline: 2 stages (layers [(0, 2), (2, 3)])" in ranks[0].stdout
    assert ranks[1].stdout == ""  # the other ranks are silent


@pytest.mark.usefixtures("plugin_references")
def test_a_split_with_a_lighter_drafting_rank_generates_what_the_pp1_engine_does(engines, capsys) -> None:
    """--first-stage-layers 1: rank 0 (which drafts) holds one target layer, rank 1 the other two; dustin-h's SRH
    layer 1 then lives on rank 1, so S_target crosses the stages, and the tokens stay the pp=1 engine's."""
    assert main([*RUN, "--engine", str(engines["pp1"])]) == 0
    expected = token_lines(capsys.readouterr().out)
    assert open_engine(engines["pp2-first1"], world_size=2, rank=0).layers == (0, 1)
    assert open_engine(engines["pp2-first1"], world_size=2, rank=1).layers == (1, 3)
    ranks = cli_ranks([[*RUN, "--engine", str(engines["pp2-first1"])]] * 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert expected and token_lines(ranks[0].stdout) == expected
    assert "pipeline: 2 stages (layers [(0, 1), (1, 3)])" in ranks[0].stdout


@pytest.mark.usefixtures("plugin_references")
def test_the_drafting_rank_rounds_an_int8_engines_draft(tmp_path: Path, capsys) -> None:
    """An engine built with --draft-weights int8: rank 0 rounds the draft it loads, and the two stages give the
    tokens the pp=1 engine gives with the same choice."""
    from dataclasses import replace

    common = dict(longspark=None, ring=None, dustin=DUSTIN, limits=replace(LIMITS, draft_weights="int8"))
    pp1, pp2 = build(tmp_path / "pp1", **common), build(tmp_path / "pp2", pp_size=2, **common)
    assert main([*RUN, "--engine", str(pp1)]) == 0
    out = capsys.readouterr().out
    rounded = "draft: 8 projections of its 2 layers in weight-only int8"
    assert rounded in out
    ranks = cli_ranks([[*RUN, "--engine", str(pp2)]] * 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert token_lines(out) and token_lines(ranks[0].stdout) == token_lines(out)
    assert rounded in ranks[0].stdout


def test_ranks_with_different_engines_refuse_at_start(engines) -> None:
    ranks = cli_ranks([[*RUN, "--engine", str(engines["pp2"])], [*RUN, "--engine", str(engines["pp2-other"])]])
    for rank in ranks:
        assert rank.returncode == 2
        error = rank.stderr.strip().splitlines()[-1]
        assert error.startswith("trtllm-dustin: error: rank 1 was started with engine manifest sha256 ")
        assert error.endswith("start every rank with the same command and engine")


@pytest.mark.usefixtures("plugin_references")
def test_a_pp_engine_without_torchrun_names_the_command(engines, capsys) -> None:
    assert main([*RUN, "--engine", str(engines["pp2"])]) == 2
    assert (f"was built for 2 pipeline stage(s) but this run has 1 process(es); launch it with `torchrun "
            f"--nproc-per-node 2 -m trtllm_dustin.cli generate --engine {engines['pp2']}`") in capsys.readouterr().err
    with pytest.raises(EngineError, match=r"built for 2 pipeline stage\(s\) but this run has 3 process\(es\)"):
        open_engine(engines["pp2"], world_size=3, rank=0)


def test_each_rank_checks_and_loads_only_its_shard(engines, tmp_path: Path) -> None:
    """Rank r hashes the shared files and rank<r>/ only, and its stage holds only its layers; chained, the stages'
    logits are the pp=1 engine's whole model's, bit for bit."""
    import shutil

    damaged = Path(shutil.copytree(engines["pp2"], tmp_path / "damaged"))
    shard = damaged / "rank1" / "target.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0xFF]))
    assert open_engine(damaged, world_size=2, rank=0).layers == (0, 2)
    with pytest.raises(EngineError, match="rank1/target.safetensors does not match its sha256"):
        open_engine(damaged, world_size=2, rank=1)

    whole = open_engine(engines["pp1"]).target.load("cpu", torch.float32).model
    tokens = torch.randint(0, whole.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    backend, lengths = get_backend("reference"), torch.zeros(2, dtype=torch.int32)
    with torch.inference_mode():
        expected = whole(tokens, KVCache.allocate(whole.config, 2, 16, torch.float32, "cpu"),
                         AttentionMetadata(cache_seqlens=lengths), backend)
        x = tokens
        for rank in range(2):
            engine = open_engine(engines["pp2"], world_size=2, rank=rank)
            start, stop = engine.layers
            stage = PipelineStage.load(engine.target.config, start, stop, rank, 2, engine.target.tensors("cpu"),
                                       engine.target.source, "cpu", torch.float32)
            assert len(stage.layers) == stop - start and (stage.embed is not None) == (rank == 0)
            assert (stage.norm is not None) == (rank == 1) and engine.draft is not None
            x = stage(x, stage.allocate_cache(2, 16, torch.float32, "cpu"), AttentionMetadata(cache_seqlens=lengths),
                      backend)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_the_ranks_memory_shares_add_up_to_the_whole_engine(engines, monkeypatch) -> None:
    """open_engine checks each rank's own weights and KV caches: the pp=2 ranks' shares sum to the pp=1 engine's
    (tiny-llama's embedding and head are separate matrices: nothing is held twice)."""
    from trtllm_dustin import kv_cache

    needed = []
    monkeypatch.setattr(kv_cache, "check_fits", lambda what, nbytes, device, headroom=0.9: needed.append(nbytes))
    open_engine(engines["pp1"])
    open_engine(engines["pp2"], world_size=2, rank=0)
    open_engine(engines["pp2"], world_size=2, rank=1)
    whole, first, last = needed
    assert first + last == whole and first > last > 0  # rank 0 also holds the draft and its cache
