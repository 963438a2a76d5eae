"""Engines: checkpoints + the search's Dustin config -> one checked, tuned directory a deployment loads as it is.

TensorRT engines cannot be built here and TensorRT-LLM itself loads checkpoints directly, so an engine is our own
build artifact: every model converted once into the runtime's fused layout, split into pipeline stages, with the
tokenizer, the Dustin config, the limits it was built for and the kernel tactic table of the GPU it was tuned on,
each file's sha256 in the manifest. A build is deterministic (the same inputs give byte-identical files) and atomic
(written in a temporary directory beside the output and renamed, so an interrupted build leaves nothing).

    <engine>/manifest.json           format version, package version, git SHA, the sources and their hashes, model
                                     fingerprints, the Dustin config, the limits, the layer split per rank, the
                                     tactic table's GPU, the sha256 of every other file
    <engine>/target_config.json      the target's ModelConfig (draft_config.json: the draft's)
    <engine>/rank<r>/target.safetensors   rank r's contiguous target layers (+ the embedding on rank 0, the final
                                     norm and output head on the last rank); rank0/draft.safetensors: the draft
                                     (in the engine's dtype: limits.draft_weights "int8" rounds its layers when a
                                     run loads it). A pipeline rank opens and checks only the files it reads
                                     (`open_engine`)
    <engine>/longspark/              a LongSpark drafter (config.json, model.safetensors), when built with one
    <engine>/ring/                   a ring drafter (config.json, model.safetensors, head_ids.safetensors where it
                                     has a subset head), when built with one (limits.draft_weights "int8" rounds it
                                     when a run loads it, as the draft)
    <engine>/tokenizer/              the target's tokenizer (save_pretrained), when it has one
    <engine>/dustin.json             the Dustin config, when built with one
    <engine>/tactics.json            the skinny-GEMM tactic table of bf16 weights: tuned on this GPU (--tune) or
                                     the packaged one (int8 weights take KernelConfig's int8 table: not recorded)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import DustinConfig, model_fingerprint
from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS
from trtllm_dustin.runtime.pipeline.layers import layer_split

__all__ = ["ENGINE_FORMAT_VERSION", "EngineError", "EngineLimits", "EngineManifest", "OpenedEngine", "build_engine",
           "engine_tactics", "open_engine", "stage_bytes"]

ENGINE_FORMAT_VERSION = 1
_DTYPES = ("bfloat16", "float16", "float32")


class EngineError(ConfigError):
    """An engine directory is missing, damaged, or does not fit the run asked of it."""


@dataclass(frozen=True)
class EngineLimits:
    """What an engine is built for; a run may ask for less, never more."""

    max_batch: int = 16  # batch slots
    max_seq_len: int = 4096  # KV cache length per slot: prompt + new tokens + gamma
    gamma: int = 3  # draft tokens per speculative round
    budget: int | None = None  # Dustin's k; None: the Dustin config's own
    dtype: str = "bfloat16"  # weights and the target's KV cache
    draft_kv_cache: str = "model"  # the draft's KV cache: "model" (dtype) or "fp8"
    draft_weights: str = "model"  # the draft's layers as run: "model" (dtype) or "int8" (rounded when loaded)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_seq_len", "gamma"):
            if getattr(self, name) < 1:
                raise EngineError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.budget is not None and self.budget < 1:
            raise EngineError(f"--budget {self.budget} must be >= 1")
        if self.dtype not in _DTYPES:
            raise EngineError(f"--dtype {self.dtype} must be one of {_DTYPES}")
        if self.draft_kv_cache not in ("model", "fp8"):
            raise EngineError(f"--draft-kv-cache {self.draft_kv_cache} must be model or fp8")
        if self.draft_weights not in DRAFTER_WEIGHTS:
            raise EngineError(f"--draft-weights {self.draft_weights} must be model or int8 (int8: the draft's layers "
                              "in weight-only int8)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def stage_bytes(configs: dict[str, ModelConfig], layers: list[tuple[int, int]], rank: int, max_batch: int,
                max_seq_len: int, dtype: torch.dtype, draft_kv_cache: str = "model") -> tuple[int, int]:
    """(weight bytes, KV cache bytes) pipeline stage `rank` holds: its target layers and their cache, the embedding
    on the first stage (and on the last with tied embeddings), the final norm and head on the last, and the draft
    (`configs["draft"]`, if any) with its cache on the first. `layers`: layer_split's ranges."""
    from trtllm_dustin.kv_cache import KVCache
    from trtllm_dustin.plugins.kv_dtype import draft_kv_dtype

    weights = caches = 0
    for role, c in configs.items():
        kv = KVCache.nbytes_for(c, max_batch, max_seq_len,
                                dtype if role == "target" else draft_kv_dtype(draft_kv_cache, dtype))
        if role != "target":
            if rank == 0:  # the draft lives on the first stage
                weights, caches = weights + c.num_parameters() * dtype.itemsize, caches + kv
            continue
        start, stop = layers[rank]
        first, last, tied = rank == 0, rank == len(layers) - 1, c.tie_word_embeddings
        ends = c.vocab_size * c.hidden_size if first or (last and tied) else 0  # the embedding (a tied head's too)
        ends += (c.hidden_size + (0 if tied else c.output_rows() * c.hidden_size)) if last else 0  # norm + head
        weights += ((stop - start) * c.layer_parameters() + ends) * dtype.itemsize
        caches += kv * (stop - start) // c.num_layers
    return weights, caches


@dataclass(frozen=True)
class EngineManifest:
    """manifest.json: everything the engine was built from and for, and the sha256 of each of its files."""

    format_version: int
    package_version: str
    git_sha: str
    sources: dict[str, dict[str, Any]]  # role -> {"spec", "files": {name: sha256}} (presets: their seed)
    fingerprints: dict[str, str]  # role -> model_fingerprint of its config
    limits: EngineLimits
    pp_size: int
    layers: list[tuple[int, int]]  # [start, stop) target layers of each rank
    tactics_gpu: str  # the GPU the tactic table was measured on
    tuned: bool  # the table was measured by this build (--tune), not the packaged one
    dustin: dict[str, Any] | None = None
    longspark: bool = False
    ring: bool = False
    files: dict[str, str] = field(default_factory=dict)  # path inside the engine -> sha256

    def to_json(self) -> str:
        data = asdict(self)
        data["layers"] = [list(r) for r in self.layers]
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> EngineManifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineError(f"{where} is not valid JSON ({e}); rebuild the engine with `trtllm-dustin build`") from e
        version = data.get("format_version")
        if version != ENGINE_FORMAT_VERSION:
            raise EngineError(f"{where}: engine format version {version!r}, this build reads version "
                              f"{ENGINE_FORMAT_VERSION}; rebuild the engine with `trtllm-dustin build`")
        try:
            data["limits"] = EngineLimits(**data["limits"])
            data["layers"] = [tuple(r) for r in data["layers"]]
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise EngineError(f"{where} lacks or mistypes a field ({e}); rebuild the engine") from e


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_files(root: Path, files: list[Path]) -> dict[str, str]:
    """sha256 of each file (path relative to root -> hex), the files hashed in parallel (hashlib releases the GIL:
    an 8B engine's 18 GB take one file's time, not the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(_sha256, files))
    return {f.relative_to(root).as_posix(): d for f, d in zip(files, digests, strict=True)}


def _source_record(spec: str | None, seed: int) -> dict[str, Any]:
    """What a model was built from: its spec and the sha256 of its files (presets: the seed of their weights)."""
    from trtllm_dustin.models.packaged import DEFAULT_DRAFT, DEFAULT_MODEL, default_draft_path, default_gguf_path

    if spec is not None and spec.startswith("preset:"):
        return {"spec": spec, "seed": seed}
    path = default_gguf_path() if spec in (None, DEFAULT_MODEL) else \
        default_draft_path() if spec == DEFAULT_DRAFT else Path(os.path.expanduser(spec))
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return {"spec": spec or DEFAULT_MODEL, "files": {p.name: _sha256(p) for p in files}}


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: tensors[k].detach().contiguous().cpu() for k in sorted(tensors)}, str(path),
              metadata={"format": "pt"})


def build_engine(out: str | Path, *, target: str | None = None, draft: str | None = None,
                 longspark: str | None = None, ring: str | None = None, dustin: DustinConfig | None = None,
                 limits: EngineLimits | None = None, pp_size: int = 1, tune: bool = False, seed: int = 0,
                 device: str = "cpu", force: bool = False, log=print, first_stage_layers: int | None = None) -> Path:
    """Build an engine at `out` (the module docstring says what it holds); returns its path.

    target / draft: what `load_model` takes (None: the default SmolLM2 target; the draft only when given).
    longspark: a LongSpark drafter for the target (a directory, "random", or None: none); ring: a ring drafter
    (a directory, "smollm2-ring", "random", or None: none; one stage only). tune: measure the
    tactic table on this CUDA device (else the packaged table is recorded). The weights are converted on `device`
    (cpu is fine: a build runs once). first_stage_layers: the first stage's target layers (it also drafts; the others
    split the rest evenly), None: an even split. Every check runs before a weight is read.
    """
    from tqdm import tqdm

    from trtllm_dustin import __version__
    from trtllm_dustin.models.loading import native_tensors, open_model
    from trtllm_dustin.models.longspark import load_longspark, longspark_config, longspark_directory
    from trtllm_dustin.models.ring_drafter import HEAD_IDS_FILE, random_ring_drafter, read_ring_checkpoint, ring_config
    from trtllm_dustin.plugins.linear_tactics import PACKAGED_LINEAR_TACTICS
    from trtllm_dustin.provenance import git_sha

    out = Path(out)
    limits = limits or EngineLimits()
    if out.exists() and not force:
        raise EngineError(f"--out {out} exists; choose another directory or pass --force to replace it")
    if tune and not torch.cuda.is_available():
        raise EngineError("--tune needs a CUDA device (it measures the kernels on the GPU the engine is for); build "
                          "without --tune to record the packaged defaults")
    # ---- every check before a weight is read
    target_ckpt = open_model(target, seed)
    draft_ckpt = open_model(draft, seed + 1, "--draft") if draft is not None else None
    tc = target_ckpt.config
    layers = layer_split(tc.num_layers, pp_size, first_stage_layers)
    if limits.max_seq_len > tc.max_position_embeddings:
        raise EngineError(f"--max-seq-len {limits.max_seq_len} exceeds the target's {tc.max_position_embeddings} "
                          "positions; lower it")
    if dustin is not None:
        dustin.check_models(tc, draft_ckpt.config if draft_ckpt is not None else None, "the --dustin-config")
        if limits.budget is not None and limits.budget != dustin.budget:
            dustin = dustin.with_budget(limits.budget)  # m scaled to the same share of the free slots
    spark_config = longspark_config(longspark) if longspark is not None else None
    if spark_config is not None:
        spark_config.check_target(tc)
    if longspark is not None:
        from trtllm_dustin.models.longspark import LongSparkConfig

        block = (spark_config or LongSparkConfig(target_layers=(0,))).block  # "random": the default shape
        if limits.gamma > block:
            raise EngineError(f"--gamma {limits.gamma} exceeds the {block} tokens this LongSpark drafter proposes per "
                              f"round (its block); lower --gamma to <= {block}")
    drafting = draft is not None or longspark is not None or ring is not None
    smallest = 2 + (limits.gamma if drafting else 0)  # one prompt token, one new token, a round's drafts
    if limits.max_seq_len < smallest:
        raise EngineError(f"--max-seq-len {limits.max_seq_len} holds no request: the smallest (1 prompt token + 1 new "
                          "token" + (f" + gamma {limits.gamma} kept free for a round's drafts" if drafting else "")
                          + f") takes {smallest}; raise it to >= {smallest}")
    if ring is not None:
        if pp_size > 1:
            raise EngineError(f"--ring with --pp-size {pp_size}: the ring methods run in one process (the ring drafter "
                              "is fed the hidden states of target layers that other stages hold); build the ring "
                              "drafter into a --pp-size 1 engine")
        ring_shape = ring_config(ring, tc)  # checked against the target
        if limits.gamma > ring_shape.block:
            raise EngineError(f"--gamma {limits.gamma} exceeds the {ring_shape.block} tokens this ring drafter "
                              f"proposes per round; lower --gamma to <= {ring_shape.block}")

    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        steps = tqdm(total=4 + pp_size + (draft is not None) + (longspark is not None) + (ring is not None),
                     desc=f"build {out.name}",
                     unit="step", disable=log is None)
        dtype = limits.torch_dtype
        loaded = target_ckpt.load(device, dtype)
        steps.update()
        model = loaded.model
        weights = native_tensors(model)
        for rank, (start, stop) in enumerate(layers):
            shard = {k: v for k, v in weights.items()
                     if k.startswith("layers.") and start <= int(k.split(".")[1]) < stop}
            if rank == 0:
                shard["embed.weight"] = weights["embed.weight"]
            if rank == pp_size - 1:
                shard |= {k: v for k, v in weights.items() if not k.startswith(("layers.", "embed."))}
                if model.lm_head is None:  # tied: the output matrix is the embedding
                    shard["embed.weight"] = weights["embed.weight"]
            _save_tensors(shard, tmp / f"rank{rank}" / "target.safetensors")
            steps.update()
        (tmp / "target_config.json").write_text(tc.to_json() + "\n")
        if draft_ckpt is not None:
            draft_model = draft_ckpt.load(device, dtype, share_with=model).model
            _save_tensors(native_tensors(draft_model), tmp / "rank0" / "draft.safetensors")
            (tmp / "draft_config.json").write_text(draft_ckpt.config.to_json() + "\n")
            steps.update()
        if longspark is not None:
            load_longspark(longspark, model, seed=seed + 1).save(tmp / "longspark")
            steps.update()
        if ring == "random":
            random_ring_drafter(model, ring_shape, seed=seed + 2).save(tmp / "ring")
            steps.update()
        elif ring is not None:  # the checkpoint's files as they are (its own weights are already small)
            (tmp / "ring").mkdir()
            source = read_ring_checkpoint(ring)[0]
            for name in ("config.json", "model.safetensors", HEAD_IDS_FILE):
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / "ring" / name)
            steps.update()
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        if dustin is not None:
            (tmp / "dustin.json").write_text(dustin.to_json() + "\n")
        steps.update()
        if tune:
            from trtllm_dustin.build_engines.tune import decode_shapes, tune_linear

            shapes = decode_shapes(tc, draft_ckpt.config if draft_ckpt is not None else None, limits.max_batch,
                                   limits.gamma)
            table = tune_linear(shapes, torch.device("cuda"), progress=log is not None)
            (tmp / "tactics.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            gpu = table["gpu"]
        else:
            shutil.copyfile(PACKAGED_LINEAR_TACTICS, tmp / "tactics.json")
            gpu = json.loads(PACKAGED_LINEAR_TACTICS.read_text())["gpu"]
        steps.update()
        sources = {"target": _source_record(target, seed)}
        fingerprints = {"target": model_fingerprint(tc)}
        if draft_ckpt is not None:
            sources["draft"] = _source_record(draft, seed + 1)
            fingerprints["draft"] = model_fingerprint(draft_ckpt.config)
        if longspark is not None:
            sources["longspark"] = {"spec": "random", "seed": seed + 1} if longspark == "random" else \
                {"spec": longspark, "files": _source_record(str(longspark_directory(longspark)), seed)["files"]}
        files = _hash_files(tmp, sorted(p for p in tmp.rglob("*") if p.is_file()))
        if ring is not None:  # its files are the checkpoint's, copied as they are: their hashes are the engine's
            sources["ring"] = {"spec": "random", "seed": seed + 2} if ring == "random" else \
                {"spec": ring, "files": {name.removeprefix("ring/"): digest for name, digest in files.items()
                                         if name.startswith("ring/")}}
        manifest = EngineManifest(
            format_version=ENGINE_FORMAT_VERSION, package_version=__version__, git_sha=git_sha(), sources=sources,
            fingerprints=fingerprints, limits=limits, pp_size=pp_size, layers=layers, tactics_gpu=gpu, tuned=tune,
            dustin=asdict(dustin) if dustin is not None else None, longspark=longspark is not None,
            ring=ring is not None, files=files)
        (tmp / "manifest.json").write_text(manifest.to_json())
        steps.update()
        steps.close()
        if out.exists():  # --force: the old engine goes only once the new one is complete
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if log is not None:
        log(f"built {out}: {tc.name}" + (f" + {draft_ckpt.config.name}" if draft_ckpt else "") +
            f", pp {pp_size} (layers {layers}), {len(manifest.files)} files, GPU kernel tactics "
            f"{'tuned on' if tune else 'packaged for'} {gpu}"
            + ("" if torch.cuda.is_available() else " (read on a GPU only; a CPU runs the PyTorch reference)"))
    return out


@dataclass
class OpenedEngine:
    """A checked engine, its models opened (configs, tokenizer) but not loaded. One stage (pp_size 1):
    `target.load(...)` reads the whole target. Several: `target.tensors(device)` are this rank's shard only, loaded
    by runtime/pipeline/stage.py `PipelineStage.load` over `layers`; the draft is loaded on rank 0."""

    directory: Path
    manifest: EngineManifest
    target: Any  # models.loading.Checkpoint over this rank's target shard
    draft: Any | None  # the same for the draft (rank0/draft.safetensors; its config on every rank)
    dustin: DustinConfig | None
    longspark: Path | None  # the LongSpark drafter's directory inside the engine
    ring: Path | None  # the ring drafter's directory inside the engine
    tactics: Path | None  # the tactic table the runtime should read (None: the packaged one; another GPU's table)
    notes: list[str] = field(default_factory=list)  # warnings to print (e.g. tuned for another GPU)
    rank: int = 0  # the pipeline stage this process opened
    sha256: str = ""  # of manifest.json: the start handshake compares it across ranks

    @property
    def layers(self) -> tuple[int, int]:
        """This rank's [start, stop) target layers."""
        return tuple(self.manifest.layers[self.rank])


def open_engine(directory: str | Path, *, device: torch.device | str = "cpu", world_size: int = 1, rank: int = 0,
                verify: bool = True, serving: bool = False) -> OpenedEngine:
    """Check an engine before anything is allocated and open its models, as pipeline rank `rank` of `world_size`
    processes. Refuses, with the value and the fix: a missing or damaged directory, another format version, a file
    whose sha256 differs (named), a config that does not match the manifest's fingerprints, a world size other
    than the engine's pipeline size. A rank hashes and checks the files it reads (the shared ones and its own shard;
    rank 0 also the draft), and the memory of its own share. An engine tuned for another GPU is used with the
    packaged tactic table (and a note says so)."""
    from functools import partial

    from trtllm_dustin.models.loading import Checkpoint, iter_safetensors

    directory, device = Path(directory), torch.device(device)
    path = directory / "manifest.json"
    if not path.is_file():
        raise EngineError(f"--engine {directory}: no manifest.json there; build one with `trtllm-dustin build --out "
                          f"{directory}`")
    manifest = EngineManifest.from_json(path.read_text(), str(path))
    if serving and manifest.pp_size > 1:  # the Triton model runs each engine in one process
        raise EngineError(f"--engine {directory} has {manifest.pp_size} pipeline stages, and serving runs an engine in "
                          "one process: rebuild it with --pp-size 1 to serve it (pipeline engines run with `torchrun "
                          f"--nproc-per-node {manifest.pp_size} -m trtllm_dustin.cli generate --engine {directory}`)")
    if world_size != manifest.pp_size:
        launch = f"`torchrun --nproc-per-node {manifest.pp_size} -m trtllm_dustin.cli generate --engine {directory}` " \
            "(and the same options)" if manifest.pp_size > 1 else "one process (without torchrun)"
        raise EngineError(f"--engine {directory} was built for {manifest.pp_size} pipeline stage(s) but this run "
                          f"has {world_size} process(es); launch it with {launch} or rebuild with --pp-size "
                          f"{world_size}")
    if not 0 <= rank < world_size:
        raise EngineError(f"rank {rank} is outside the {world_size} processes of this run")
    if verify:
        mine = {name: digest for name, digest in manifest.files.items() if _read_by(name, rank)}
        missing = [name for name in mine if not (directory / name).is_file()]
        if missing:
            raise EngineError(f"--engine {directory}: {missing[0]} is missing; rebuild the engine")
        found = _hash_files(directory, [directory / name for name in mine])
        for name, digest in mine.items():
            if found[name] != digest:
                raise EngineError(f"--engine {directory}: {name} does not match its sha256 in manifest.json (the "
                                  "file was changed or damaged); rebuild the engine")
    configs = {}
    for role in manifest.fingerprints:
        config = ModelConfig.from_json((directory / f"{role}_config.json").read_text())
        if model_fingerprint(config) != manifest.fingerprints[role]:
            raise EngineError(f"--engine {directory}: {role}_config.json does not match the manifest's "
                              f"fingerprint; rebuild the engine")
        configs[role] = config
    _check_memory(directory, manifest, configs, device, rank)
    dustin = DustinConfig.load(directory / "dustin.json") if manifest.dustin is not None else None
    if dustin is not None:
        dustin.check_models(configs["target"], configs.get("draft"))
    tokenizer = None
    if (directory / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
    about = f"engine {directory.name} ({manifest.limits.dtype}, built at git {manifest.git_sha[:12]})"

    def shard(role: str, owner: int) -> Checkpoint:
        file = directory / f"rank{owner}" / f"{role}.safetensors"
        return Checkpoint(configs[role], tokenizer, f"{directory}/{file.relative_to(directory)}", about,
                          partial(iter_safetensors, [file], fix="rebuild the engine"), native=True)

    tactics, notes = engine_tactics(directory, manifest,
                                    torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    return OpenedEngine(directory, manifest, shard("target", rank), shard("draft", 0) if "draft" in configs else None,
                        dustin, directory / "longspark" if manifest.longspark else None,
                        directory / "ring" if manifest.ring else None, tactics, notes, rank,
                        _sha256(path))


def check_serves(engine: OpenedEngine, methods: Sequence[str]) -> None:
    """Raise EngineError, naming the method, the part and the build option that adds it, when the engine lacks what
    one of `methods` runs with: a draft model, a LongSpark or ring drafter, a Dustin config."""
    from trtllm_dustin.runtime.methods import METHODS

    parts = (("needs_draft", "a draft model", engine.draft, "--draft"),
             ("needs_longspark", "a LongSpark drafter", engine.longspark, "--longspark"),
             ("needs_ring", "a ring drafter", engine.ring, "--ring"),
             ("needs_dustin", "a Dustin config", engine.dustin, "--dustin-config"))
    for method in methods:
        for flag, what, there, option in parts:
            if getattr(METHODS[method], flag) and there is None:
                raise EngineError(f"--method {method} needs {what}; the engine {engine.directory} has none (rebuild "
                                  f"it with {option})")


def _read_by(name: str, rank: int) -> bool:
    """Whether pipeline rank `rank` reads the engine file `name`: the shared files, its own shard directory."""
    top = name.split("/", 1)[0]
    return not (top.startswith("rank") and top[4:].isdigit()) or top == f"rank{rank}"


def engine_tactics(directory: Path, manifest: EngineManifest, gpu: str | None) -> tuple[Path | None, list[str]]:
    """The tactic table a run on `gpu` (None: not a GPU) reads, and a note when the engine's does not apply: a table
    tuned on another GPU gives way to the packaged one (None)."""
    if manifest.tuned and gpu is not None and gpu != manifest.tactics_gpu:
        return None, [f"note: --engine {directory} was tuned on {manifest.tactics_gpu}, this is {gpu}: using the "
                      "packaged kernel tactics (rebuild with --tune on this GPU for its own)"]
    return directory / "tactics.json", []


def _check_memory(directory: Path, manifest: EngineManifest, configs: dict[str, ModelConfig],
                  device: torch.device, rank: int = 0) -> None:
    """Rank `rank`'s share of the engine's weights and of the KV caches of its limits must fit in `device`'s free
    memory (nothing allocated): its target layers (and their cache), the embedding or the head where it holds them,
    the draft on rank 0, and a ring drafter's own weights (one stage only)."""
    from trtllm_dustin.kv_cache import MemoryPlanError, check_fits
    from trtllm_dustin.models.ring_drafter import ring_weight_bytes

    limits = manifest.limits
    weights, caches = stage_bytes(configs, manifest.layers, rank, limits.max_batch, limits.max_seq_len,
                                  limits.torch_dtype, limits.draft_kv_cache)
    if manifest.ring:
        weights += ring_weight_bytes(directory / "ring", configs["target"], limits.torch_dtype.itemsize)
    try:
        check_fits(f"--engine {directory} (weights {weights / 2**30:.2f} GiB + KV caches of its limits, "
                   f"{limits.max_batch} x {limits.max_seq_len} tokens, {caches / 2**30:.2f} GiB)", weights + caches,
                   device)
    except MemoryPlanError as e:
        raise EngineError(f"{e}; or rebuild the engine with a smaller --max-batch / --max-seq-len") from None

