"""Engines (build_engines/engine.py): build -> open -> generate equals generate from the sources; a rebuild is
byte-identical; every refusal names the value and the fix; an interrupted build leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.engines import DRAFT, DUSTIN, LIMITS, TARGET, build

from trtllm_dustin.build_engines import engine as engine_module
from trtllm_dustin.build_engines.engine import (
    EngineError,
    EngineLimits,
    EngineManifest,
    engine_tactics,
    open_engine,
)
from trtllm_dustin.cli import main
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.runtime.pipeline import layer_split


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("engines") / "tiny")


def generated(capsys, argv: list[str]) -> list[str]:
    """The token lines `trtllm-dustin generate` prints."""
    assert main(argv) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]


@pytest.mark.parametrize("method", ["vanilla", "dustin-h", "dustin-t-longspark", "ring"])
def test_engine_generates_what_its_sources_generate(engine_dir: Path, capsys, method: str) -> None:
    """The round trip: the engine's weights, Dustin config and LongSpark and ring drafters give the tokens the source
    models give (same seeds): vanilla greedy and sampled, dustin-h sampled, dustin-t-longspark and ring greedy."""
    common = ["generate", "--prompt-tokens", "30", "--max-new-tokens", "12", "--method", method, "--device", "cpu",
              "--batch-size", "2", "--seed", "3"]
    samplings = ([], ["--temperature", "0.8", "--top-p", "0.9"]) if method == "vanilla" else ([],)
    if method == "dustin-h":
        samplings = (["--temperature", "0.8", "--top-p", "0.9"],)
    for sampling in samplings:
        from_engine = generated(capsys, [*common, *sampling, "--engine", str(engine_dir)])
        dustin = engine_dir / "dustin.json"
        sources = ["--model", TARGET, "--dtype", "float32"]
        sources += ["--dustin-config", str(dustin)] if "dustin" in method else []  # the others refuse one
        sources += ["--draft", DRAFT] if method == "dustin-h" else []
        sources += ["--longspark", str(engine_dir / "longspark")] if "longspark" in method else []
        sources += ["--ring", str(engine_dir / "ring")] if method == "ring" else []
        assert from_engine and from_engine == generated(capsys, [*common, *sampling, *sources])


def test_rebuild_is_byte_identical(engine_dir: Path, tmp_path: Path) -> None:
    again = build(tmp_path / "again")
    files = sorted(p.relative_to(engine_dir) for p in engine_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for name in files:
        assert (engine_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_manifest_records_sources_limits_and_every_file(engine_dir: Path) -> None:
    manifest = EngineManifest.from_json((engine_dir / "manifest.json").read_text(), "manifest")
    assert manifest.limits == LIMITS and manifest.pp_size == 1 and manifest.layers == [(0, 3)]
    assert manifest.sources["target"] == {"spec": TARGET, "seed": 3}
    assert set(manifest.fingerprints) == {"target", "draft"} and manifest.longspark and manifest.ring
    assert manifest.sources["ring"] == {"spec": "random", "seed": 5}
    on_disk = {p.relative_to(engine_dir).as_posix() for p in engine_dir.rglob("*") if p.is_file()}
    assert set(manifest.files) == on_disk - {"manifest.json"}
    assert manifest.tactics_gpu == "NVIDIA H200" and not manifest.tuned  # the packaged table


def test_pipeline_shards_hold_contiguous_layers(tmp_path: Path) -> None:
    from safetensors import safe_open

    assert layer_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    out = build(tmp_path / "pp", pp_size=2, draft=None, dustin=None, longspark=None, ring=None)
    names = []
    for rank in range(2):
        with safe_open(str(out / f"rank{rank}" / "target.safetensors"), framework="pt") as f:
            names.append(set(f.keys()))
    assert "embed.weight" in names[0] and "lm_head.weight" in names[1] and "norm.weight" in names[1]
    assert {int(n.split(".")[1]) for n in names[0] if n.startswith("layers.")} == {0, 1}
    assert {int(n.split(".")[1]) for n in names[1] if n.startswith("layers.")} == {2}
    with pytest.raises(EngineError, match=r"built for 2 pipeline stage\(s\) but this run has 1 process"):
        open_engine(out)
    with pytest.raises(EngineError, match="serving runs an engine in one process: rebuild it with --pp-size 1"):
        open_engine(out, serving=True)  # what triton-repo and the served model open it with
    with pytest.raises(ConfigError, match="--pp-size 9 must be between 1 and the target's 3 layers"):
        layer_split(3, 9)


def test_a_split_can_give_the_drafting_rank_fewer_layers(tmp_path: Path) -> None:
    """--first-stage-layers n: the first stage holds n layers, the others split the rest as the even split does;
    the build writes its shards by that split and records it; impossible counts are refused with the range."""
    from safetensors import safe_open

    from trtllm_dustin.runtime.pipeline import check_split

    assert layer_split(32, 4, first=5) == [(0, 5), (5, 14), (14, 23), (23, 32)]
    assert layer_split(30, 4, first=6) == [(0, 6), (6, 14), (14, 22), (22, 30)]
    assert layer_split(30, 2, first=15) == layer_split(30, 2) and layer_split(7, 1, first=7) == [(0, 7)]
    for n, p in ((32, 4), (80, 4), (48, 2), (3, 3)):
        for first in range(1, n - p + 2):
            split = layer_split(n, p, first)
            assert check_split(split, n, p) == split and split[0] == (0, first)
            sizes = [b - a for a, b in split[1:]]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n - first
    with pytest.raises(ConfigError, match=r"--first-stage-layers 3 must be between 1 and 2 \(the target's 3 layers"):
        layer_split(3, 2, first=3)
    with pytest.raises(ConfigError, match="--first-stage-layers 0 must be between 1 and 2"):
        layer_split(3, 2, first=0)
    with pytest.raises(ConfigError, match="one stage holds all 3 layers"):
        layer_split(3, 1, first=2)
    for bad in ([(0, 2), (3, 4)], [(0, 2)], [(1, 2), (2, 4)], [(0, 0), (0, 4)], [(0, 2), (2, 5)]):
        with pytest.raises(ConfigError, match="is not 2 contiguous non-empty ranges covering the target's 4 layers"):
            check_split(bad, 4, 2)
    out = build(tmp_path / "pp", pp_size=2, draft=None, dustin=None, longspark=None, ring=None, first_stage_layers=1)
    assert EngineManifest.from_json((out / "manifest.json").read_text(), "m").layers == [(0, 1), (1, 3)]
    held = []
    for rank in range(2):
        with safe_open(str(out / f"rank{rank}" / "target.safetensors"), framework="pt") as f:
            held.append({int(n.split(".")[1]) for n in f.keys() if n.startswith("layers.")})
    assert held == [{0}, {1, 2}]
    with pytest.raises(ConfigError, match="--first-stage-layers 3 must be between 1 and 2"):
        build(tmp_path / "bad", pp_size=2, draft=None, dustin=None, longspark=None, ring=None, first_stage_layers=3)
    assert not (tmp_path / "bad").exists()


def copy_engine(engine_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(engine_dir, tmp_path / "copy"))


def test_refusals_name_the_file_and_the_fix(engine_dir: Path, tmp_path: Path) -> None:
    bad = copy_engine(engine_dir, tmp_path)
    shard = bad / "rank0" / "draft.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"rank0/draft.safetensors does not match its sha256.*rebuild"):
        open_engine(bad)

    manifest = json.loads((engine_dir / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(EngineError, match="engine format version 99, this build reads version 1"):
        open_engine(bad)

    # a config that is not the one the fingerprints were taken of (its sha256 updated, as a careless edit would)
    config = json.loads((engine_dir / "target_config.json").read_text()) | {"num_layers": 4}
    (bad / "target_config.json").write_text(json.dumps(config))
    files = manifest["files"] | {"target_config.json": engine_module._sha256(bad / "target_config.json"),
                                 "rank0/draft.safetensors": engine_module._sha256(shard)}
    (bad / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    with pytest.raises(EngineError, match="target_config.json does not match the manifest's fingerprint"):
        open_engine(bad)

    with pytest.raises(EngineError, match="no manifest.json there; build one with"):
        open_engine(tmp_path / "nowhere")


def test_limits_that_do_not_fit_are_refused(engine_dir: Path, monkeypatch) -> None:
    from trtllm_dustin import kv_cache

    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 1 << 20)
    with pytest.raises(EngineError, match=r"needs .* GiB but only .* free.*smaller --max-batch / --max-seq-len"):
        open_engine(engine_dir)


def test_a_table_tuned_on_another_gpu_gives_way_to_the_packaged_one(engine_dir: Path) -> None:
    manifest = EngineManifest.from_json((engine_dir / "manifest.json").read_text(), "m")
    tuned = EngineManifest(**{**manifest.__dict__, "tuned": True, "tactics_gpu": "NVIDIA H100"})
    assert engine_tactics(engine_dir, tuned, "NVIDIA H100") == (engine_dir / "tactics.json", [])
    table, notes = engine_tactics(engine_dir, tuned, "NVIDIA H200")
    assert table is None and "tuned on NVIDIA H100, this is NVIDIA H200" in notes[0]
    assert engine_tactics(engine_dir, tuned, None) == (engine_dir / "tactics.json", [])


def test_run_limits_and_missing_parts_are_refused(engine_dir: Path, tmp_path: Path, capsys) -> None:
    base = ["generate", "--engine", str(engine_dir), "--prompt-tokens", "8", "--device", "cpu"]
    for extra, message in ((["--batch-size", "3"], "--batch-size 3 exceeds the engine's 2"),
                           (["--model", TARGET], "--engine brings its own models and configs; drop --model"),
                           (["--dtype", "bfloat16"], "the engine's weights are float32")):
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main([*base, "--method", "ring", "--ring", "random"]) == 2
    assert "--engine brings its own models and configs; drop --ring" in capsys.readouterr().err
    plain = build(tmp_path / "plain", draft=None, dustin=None, longspark=None, ring=None)
    assert main(["generate", "--engine", str(plain), "--prompt-tokens", "8", "--method", "classic"]) == 2
    assert "needs a draft model; the engine" in capsys.readouterr().err
    assert main(["generate", "--engine", str(plain), "--prompt-tokens", "8", "--method", "ring"]) == 2
    assert f"--method ring needs a ring drafter; the engine {plain} has none (rebuild it with --ring)" in \
        capsys.readouterr().err
    # a repository of the engine is refused as it is written, not first when the server loads it; so is a served
    # config that names such a method
    for method, what, option in (("classic", "a draft model", "--draft"), ("dustin-t-longspark", "a LongSpark drafter",
                                 "--longspark"), ("dustin-ip-ring", "a ring drafter", "--ring")):
        assert main(["triton-repo", "--out", str(tmp_path / "repo"), "--engine", str(plain), "--method", "vanilla",
                     method, "--max-batch", "2", "--max-seq-len", "96"]) == 2
        assert f"--method {method} needs {what}; the engine {plain} has none (rebuild it with {option})" in \
            capsys.readouterr().err
        assert not (tmp_path / "repo").exists()
    from trtllm_dustin.serving import ServingConfig
    from trtllm_dustin.serving.engine import served_decoders

    with pytest.raises(EngineError, match="--method dustin-h needs a draft model"):
        served_decoders(ServingConfig(engine=str(plain), methods=("dustin-h",), max_batch=2, max_seq_len=96))


def test_build_refuses_before_reading_weights(tmp_path: Path, engine_dir: Path) -> None:
    with pytest.raises(EngineError, match="exists; choose another directory or pass --force"):
        build(engine_dir)
    with pytest.raises(EngineError, match="--max-seq-len 100000 exceeds the target's"):
        build(tmp_path / "long", limits=EngineLimits(max_seq_len=100000))
    with pytest.raises(EngineError, match="--ring with --pp-size 2: the ring methods run in one process"):
        build(tmp_path / "pp", pp_size=2, draft=None, dustin=None, longspark=None)
    with pytest.raises(ConfigError, match=r"ring drafter layers \[3, 9, 10, 15, 20, 22, 29\] do not exist in tiny"):
        build(tmp_path / "packaged", ring="smollm2-ring")
    assert not (tmp_path / "pp").exists() and not (tmp_path / "packaged").exists()
    other = DustinConfig(**{**DUSTIN.__dict__, "target_fingerprint": "0123456789abcdef"})
    with pytest.raises(Exception, match="searched for another target"):
        build(tmp_path / "other", dustin=other)
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="--tune needs a CUDA device"):
            build(tmp_path / "tuned", tune=True)
    assert not any(tmp_path.iterdir())


def test_an_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    real = engine_module._save_tensors
    calls = []

    def fail_second(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(tensors, path)

    monkeypatch.setattr(engine_module, "_save_tensors", fail_second)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "cut")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(engine_module, "_save_tensors", real)
    build(tmp_path / "cut")  # and a complete build then lands where the cut one would have
    assert (tmp_path / "cut" / "manifest.json").is_file()


def test_served_from_an_engine_as_from_its_sources(engine_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """triton-repo --engine stores the engine's absolute path (checked when the repository is written, refused past
    its limits), and the serving engine answers a request as it does from the source models."""
    import threading

    from trtllm_dustin.serving import ServingConfig
    from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine

    monkeypatch.chdir(engine_dir.parent)
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--out", str(repo), "--engine", engine_dir.name, "--method", "dustin-h",
                 "--max-batch", "2", "--max-seq-len", "96"]) == 0
    stored = ServingConfig.load(repo / "dustin" / "1" / "serving_config.json")
    assert stored.engine == str(engine_dir.resolve())
    assert main(["triton-repo", "--out", str(repo), "--engine", engine_dir.name, "--max-batch", "4"]) == 2

    def answer(config: ServingConfig) -> str:
        engine, done, pieces = ServingEngine.from_config(config), threading.Event(), []
        try:
            engine.submit(GenerationRequest(text="", input_ids=tuple(range(5, 40)), max_tokens=10), lambda c: (
                pieces.append(c), c.final and done.set()))
            assert done.wait(120) and pieces[-1].error is None
        finally:
            engine.close()
        return pieces[-1].text

    sources = ServingConfig(model=TARGET, draft=DRAFT, dustin=DustinConfig.load(engine_dir / "dustin.json"),
                            methods=("dustin-h",), max_batch=2, max_seq_len=96, dtype="float32", weights_seed=3)
    assert answer(stored) == answer(sources)


def test_an_engine_records_its_draft_weights_and_runs_with_them(tmp_path: Path, capsys, plugin_references) -> None:
    """build --draft-weights int8 records the choice in the manifest (the draft stored as it is); generate and the
    serving engine take the engine's choice as they take its --draft-kv-cache, and round the draft's layers when they
    load it: greedy tokens as from the sources with --draft-weights int8. A manifest written before the field reads
    as "model"; a value outside model / int8 is refused."""
    from dataclasses import replace

    from trtllm_dustin.models.quantize import Int8Linear
    from trtllm_dustin.serving import ServingConfig
    from trtllm_dustin.serving.engine import served_decoders

    out = tmp_path / "int8"
    assert main(["build", "--out", str(out), "--model", TARGET, "--draft", DRAFT, "--max-batch", "2", "--max-seq-len",
                 "96", "--dtype", "float32", "--seed", "3", "--device", "cpu", "--draft-weights", "int8"]) == 0
    manifest = EngineManifest.from_json((out / "manifest.json").read_text(), "manifest")
    assert manifest.limits == replace(LIMITS, draft_weights="int8")
    assert EngineManifest.from_json(manifest.to_json(), "again") == manifest
    data = json.loads((out / "manifest.json").read_text())
    del data["limits"]["draft_weights"]  # as an engine built before --draft-weights wrote it
    assert EngineManifest.from_json(json.dumps(data), "old").limits.draft_weights == "model"
    with pytest.raises(EngineError, match="--draft-weights int4 must be model or int8"):
        EngineLimits(draft_weights="int4")

    common = ["generate", "--prompt-tokens", "30", "--max-new-tokens", "12", "--method", "classic", "--device", "cpu",
              "--batch-size", "2", "--seed", "3"]
    rounded = "draft: 8 projections of its 2 layers in weight-only int8"
    assert main([*common, "--engine", str(out), "--draft-weights", "model"]) == 0  # the engine's choice stands
    printed = capsys.readouterr().out
    from_engine = [line for line in printed.splitlines() if line.startswith("[")]
    assert rounded in printed and from_engine
    assert from_engine == generated(capsys, [*common, "--model", TARGET, "--draft", DRAFT, "--dtype", "float32",
                                             "--draft-weights", "int8"])

    served = served_decoders(ServingConfig(engine=str(out), methods=("classic",), max_batch=2, max_seq_len=96))
    draft = served.decoders["classic"].drafter.model
    layers = [m for m in draft.layers.modules() if isinstance(m, (Int8Linear, torch.nn.Linear))]
    assert len(layers) == 8 and all(isinstance(m, Int8Linear) for m in layers)


def test_the_balanced_split_equalises_the_slowest_stage() -> None:
    """balanced_first_stage against hand-worked splits: with no extra work the even split; a drafting rank whose
    drafting costs 10 layers' forward takes 11 of 32 layers at PP = 2 (11 + 10 against 21); a head worth 2 layers
    on the last stage of 4 moves a layer to the first; ties keep the larger first stage."""
    from trtllm_dustin.runtime.pipeline import balanced_first_stage

    assert balanced_first_stage(32, 2, 0.0, 1.0) == 16
    assert balanced_first_stage(32, 2, 10.0, 1.0) == 11
    assert balanced_first_stage(32, 2, 9.0, 1.0) == 12  # 12 + 9 | 20 and 11 + 9 | 21 tie at 21: the larger
    # a head worth 2 layers: 9 | 8 8 7 + 2 (slowest 9) beats the even 8 | 8 8 8 + 2 (10) and 10 | 8 7 7 + 2 (10)
    assert balanced_first_stage(32, 4, 0.0, 1.0, last_extra_ms=2.0) == 9
    assert balanced_first_stage(32, 4, 3.0, 1.0) == 6  # 6 + 3 | 9 9 8 and 5 + 3 | 9 9 9 tie at 9: the larger
    assert balanced_first_stage(5, 1, 4.0, 1.0) == 5
    with pytest.raises(ValueError, match="must be >= 0 and layer_ms 0"):
        balanced_first_stage(32, 2, 1.0, 0.0)
