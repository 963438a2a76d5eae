"""Build a Transformer from a preset (random weights), a Hugging Face checkpoint directory or a GGUF file.

`open_model` reads what a model is without its weights: the config and tokenizer (a GGUF file is parsed here, once).
`Checkpoint.load` then creates the weights on the meta device and materialises them directly on the target device,
so an 8B preset initialises on the GPU in seconds and a checkpoint is copied tensor by tensor without a second full
copy in host memory. Everything that can be checked (architecture, files, tensor names and shapes, memory) is
checked before the weights are touched; `load_model` does both steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trtllm_dustin.config import HF_HEAD_KEY, ConfigError, ModelConfig
from trtllm_dustin.fetch import FETCHABLE, fetched_path
from trtllm_dustin.kv_cache import check_fits
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.errors import ModelLoadError
from trtllm_dustin.models.packaged import (
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    default_draft_path,
    default_dustin_config_path,
    default_gguf_path,
)
from trtllm_dustin.models.presets import get_preset

__all__ = ["DEFAULT_DRAFT", "DEFAULT_MODEL", "Checkpoint", "LoadedModel", "ModelLoadError", "copy_native",
           "default_draft_path", "default_dustin_config_path", "default_gguf_path", "iter_safetensors", "load_model",
           "native_tensors", "open_model", "save_hf_checkpoint"]

SHARED_KEY = "dustin_shares_target_embedding"  # config.json flag: embedding/output rows come from the target
HEAD_IDS = "dustin.head_ids"  # safetensors name of a subset head's vocabulary ids

TensorSource = Callable[[torch.device], Iterator[tuple[str, torch.Tensor]]]  # (HF name, tensor) pairs, on demand


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any | None  # a transformers tokenizer, or None for random-weight presets
    source: str  # what was loaded, for messages and result files


@dataclass(frozen=True)
class Checkpoint:
    """A model opened but not loaded: its config and tokenizer are read, its weights are not (`load` reads them),
    so that every limit can be checked against the config first."""

    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None for random-weight presets
    source: str  # what was opened, for messages and result files
    about: str  # what the weights are (format, tensor types), for messages
    tensors: TensorSource | None  # the weights under Hugging Face names; None: random weights from `seed`
    seed: int = 0
    shared: bool = False  # a draft without embedding and output matrix: load(share_with=target) supplies them
    native: bool = False  # `tensors` are under our own parameter names, in our fused layout (an engine's shards)

    def load(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             max_positions: int | None = None, share_with: Transformer | None = None) -> LoadedModel:
        """The model on `device` in `dtype` (rotary tables for max_positions; None: the config's).

        share_with: the target, for a checkpoint that takes its embedding and output matrix from it (`shared`);
        ignored by checkpoints that carry their own.
        """
        device = torch.device(device)
        if self.shared and share_with is None:
            raise ModelLoadError(f"{self.source} is a draft that shares its target's embedding and output matrix; "
                                 "load it with load_model(..., share_with=target_model) (the CLI does this for "
                                 "--draft)")
        model = _empty_model(self.config, device, dtype, max_positions)
        if self.tensors is None:
            _random_init(model, self.seed)
        elif self.native:
            copy_native(model, self.tensors(device), self.source)
        else:
            _copy_tensors(model, self.tensors(device), self.source, share_with if self.shared else None)
        return LoadedModel(model.eval(), self.tokenizer, self.source)


def _hf_names(config: ModelConfig, shared: bool = False) -> dict[str, tuple[str, slice | None]]:
    """Hugging Face tensor name -> (our parameter name, slice of it), for Llama/Qwen2 checkpoints.

    shared: the embedding and output matrix are not in the checkpoint (they come from the target).
    """
    D = config.head_dim
    q, kv = config.num_heads * D, config.num_kv_heads * D
    names: dict[str, tuple[str, slice | None]] = {"model.norm.weight": ("norm.weight", None)}
    if not shared:
        names["model.embed_tokens.weight"] = ("embed.weight", None)
        if not config.tie_word_embeddings:
            names["lm_head.weight"] = ("lm_head.weight", None)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names[hf + "input_layernorm.weight"] = (ours + "attention_norm.weight", None)
        names[hf + "post_attention_layernorm.weight"] = (ours + "ffn_norm.weight", None)
        for suffix in ("weight", "bias") if config.qkv_bias else ("weight",):
            names[hf + f"self_attn.q_proj.{suffix}"] = (ours + f"attention.wqkv.{suffix}", slice(0, q))
            names[hf + f"self_attn.k_proj.{suffix}"] = (ours + f"attention.wqkv.{suffix}", slice(q, q + kv))
            names[hf + f"self_attn.v_proj.{suffix}"] = (ours + f"attention.wqkv.{suffix}", slice(q + kv, q + 2 * kv))
        names[hf + "self_attn.o_proj.weight"] = (ours + "attention.wo.weight", None)
        ffn = config.intermediate_size
        names[hf + "mlp.gate_proj.weight"] = (ours + "feed_forward.w_gate_up.weight", slice(0, ffn))
        names[hf + "mlp.up_proj.weight"] = (ours + "feed_forward.w_gate_up.weight", slice(ffn, 2 * ffn))
        names[hf + "mlp.down_proj.weight"] = (ours + "feed_forward.w_down.weight", None)
    return names


def save_hf_checkpoint(model: Transformer, directory: str | Path, max_shard_bytes: int = 15 << 20,
                       shared: bool = False) -> None:
    """Write `model` as a Hugging Face Llama/Qwen2 checkpoint (config.json + safetensors shards) that
    `load_model(directory)` and `transformers` both read.

    shared=True writes a draft without its embedding and output matrix: `load_model(directory, share_with=target)`
    takes them from the target (output rows at the draft's head_ids). Such a checkpoint is ours only.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen2Config

    c = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rope = {"rope_type": c.rope_scaling.rope_type, "rope_theta": c.rope_theta,
            **{k: v for k, v in asdict(c.rope_scaling).items() if k != "rope_type" and v is not None}}
    if c.rope_scaling.rope_type == "default":
        rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    cls = Qwen2Config if c.qkv_bias else LlamaConfig
    hf = cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
             num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
             intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_parameters=rope,
             max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
             bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None)
    if shared or c.head_vocab_size:
        setattr(hf, SHARED_KEY, shared)
        setattr(hf, HF_HEAD_KEY, c.head_vocab_size)
    hf.save_pretrained(directory)
    params = dict(model.named_parameters())
    tensors = {}
    for hf_name, (ours, part) in _hf_names(c, shared).items():
        t = params[ours] if part is None else params[ours][part]
        tensors[hf_name] = t.detach().to("cpu", copy=True).contiguous()
    if model.head_ids is not None:
        tensors[HEAD_IDS] = model.head_ids.to("cpu", torch.int32, copy=True)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():  # shards small enough to travel back from the GPU machine (16 MiB a file)
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, indent=1))


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int | None
                 ) -> Transformer:
    itemsize = torch.empty((), dtype=dtype).element_size()
    check_fits(f"weights of {config.name} ({config.num_parameters() / 1e9:.2f} B parameters)",
               config.num_parameters() * itemsize, device)
    with torch.device("meta"):
        model = Transformer(config, max_positions).to(dtype)
    model = model.to_empty(device=device).requires_grad_(False)  # inference only
    if model.head_ids is not None:  # buffers are not materialised by to_empty; the checkpoint overwrites this
        model.head_ids.copy_(torch.arange(config.head_vocab_size, device=device))
    model.setup_rope()
    return model


def _random_init(model: Transformer, seed: int) -> None:
    """N(0, 1/fan_in) weights on the model's device (fast on GPU); norms at 1, biases small."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)  # a stage may have no embedding
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)


def _copy_tensors(model: Transformer, tensors: Iterator[tuple[str, torch.Tensor]], source: str,
                  shared_from: Transformer | None = None) -> None:
    """Copy (HF name, tensor) pairs into the model, checking names and shapes; every parameter must be filled.

    shared_from: a checkpoint without embedding/output matrix takes them from this (same vocabulary and width).
    """
    names = _hf_names(model.config, shared_from is not None)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    head_ids_loaded = model.head_ids is None
    with torch.no_grad():
        for hf_name, tensor in tensors:
            if hf_name == HEAD_IDS and model.head_ids is not None:
                if tuple(tensor.shape) != tuple(model.head_ids.shape):
                    raise ModelLoadError(f"{source}: {HEAD_IDS} has shape {tuple(tensor.shape)}, the config implies "
                                         f"{tuple(model.head_ids.shape)}")
                ids = tensor.long()
                if int(ids.min()) < 0 or int(ids.max()) >= model.config.vocab_size or ids.unique().numel() != len(ids):
                    raise ModelLoadError(f"{source}: {HEAD_IDS} must be distinct ids below {model.config.vocab_size}")
                model.head_ids.copy_(ids)
                head_ids_loaded = True
                continue
            if hf_name not in names:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelLoadError(f"{source}: unexpected tensor {hf_name!r}; is this a Llama/Qwen2 checkpoint?")
            ours, part = names[hf_name]
            target = params[ours] if part is None else params[ours][part]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(f"{source}: tensor {hf_name} has shape {tuple(tensor.shape)}, the config "
                                     f"implies {tuple(target.shape)}; the weights and config.json disagree")
            target.copy_(tensor)
            filled[ours] = filled.get(ours, 0) + target.numel()
        if not head_ids_loaded:
            raise ModelLoadError(f"{source}: the config declares a {model.config.head_vocab_size}-row output head "
                                 f"but the checkpoint has no {HEAD_IDS}")
        if shared_from is not None:
            _take_shared(model, shared_from, source)
            filled["embed.weight"] = model.embed.weight.numel()
            if model.lm_head is not None:
                filled["lm_head.weight"] = model.lm_head.weight.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} parameters have no weights in the checkpoint "
                             f"(first: {missing[0]}); the checkpoint is incomplete")


def native_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under our own names and fused layout (parameters and the subset head's ids): what an
    engine's shards hold and `copy_native` reads back."""
    tensors = dict(model.named_parameters())
    if model.head_ids is not None:
        tensors[HEAD_IDS] = model.head_ids.to(torch.int32)
    return tensors


def copy_native(model: Transformer, tensors: Iterator[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (our name, tensor) pairs (`native_tensors`' layout) into the model; every parameter must be filled once,
    with its own shape."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name == HEAD_IDS and model.head_ids is not None:
                model.head_ids.copy_(tensor.long())
                continue
            if name not in params:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for {model.config.name}; the shard and "
                                     "its config disagree, rebuild the engine")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                                     f"{tuple(params[name].shape)}; rebuild the engine")
            params[name].copy_(tensor)
            filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} parameters have no weights (first: {missing[0]}); the "
                             "engine is incomplete, rebuild it")


def _take_shared(model: Transformer, target: Transformer, source: str) -> None:
    """Fill a draft's embedding and output matrix from the target's (same tokenizer, same width)."""
    c, t = model.config, target.config
    if (c.vocab_size, c.hidden_size) != (t.vocab_size, t.hidden_size):
        raise ModelLoadError(f"{source} shares the embedding of a target with vocabulary {c.vocab_size} and width "
                             f"{c.hidden_size}; the given target has {t.vocab_size} and {t.hidden_size}")
    model.embed.weight.copy_(target.embed.weight)
    if model.lm_head is not None:
        rows = target.output_weight()
        model.lm_head.weight.copy_(rows[model.head_ids.to(rows.device)] if model.head_ids is not None else rows)


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e}); re-save the checkpoint") from e
        files = [directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} holds no *.safetensors weights; save the checkpoint with "
                             "save_pretrained(..., safe_serialization=True)")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ModelLoadError(f"{directory}: weight shard(s) {absent} listed in the index are missing")
    return files


def iter_safetensors(files: list[Path], device: torch.device, fix: str = "re-download or re-save it"
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the files, loaded onto `device`; an unreadable file names itself and `fix`."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or unreadable ({e}); {fix}") from e


def _open_hf_dir(directory: Path) -> Checkpoint:
    from transformers import AutoConfig, AutoTokenizer

    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        hf_config = AutoConfig.from_pretrained(directory)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{directory / 'config.json'} cannot be parsed ({e})") from e
    config = ModelConfig.from_hf(hf_config, name=directory.name)
    files = _safetensors_files(directory)
    tokenizer = None
    if any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        tokenizer = AutoTokenizer.from_pretrained(directory)
    return Checkpoint(config, tokenizer, str(directory), f"safetensors, {len(files)} file(s)",
                      partial(iter_safetensors, files), shared=bool(getattr(hf_config, SHARED_KEY, False)))


def _open_gguf(path: Path) -> Checkpoint:
    """Parse the file once: the config and the tokenizer come from its metadata, the tensors from the same mapping."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("reading GGUF files needs the package gguf; `pip install gguf`")
    from trtllm_dustin.models.gguf import GGUFFile
    from trtllm_dustin.models.gguf_model import gguf_config, hf_tensors
    from trtllm_dustin.models.gguf_tokenizer import gguf_tokenizer

    gguf = GGUFFile.open(path)
    config = gguf_config(gguf, path.stem)
    types = Counter(info.type_name for info in gguf.tensors.values())
    about = f"GGUF v{gguf.version}, {len(gguf.tensors)} tensors (" + \
        ", ".join(f"{name} {n}" for name, n in types.most_common()) + ")"
    return Checkpoint(config, gguf_tokenizer(gguf), str(path), about, lambda device: hf_tensors(gguf, config))


def open_model(spec: str | None = None, seed: int = 0, option: str = "--model") -> Checkpoint:
    """Open `spec` without reading its weights: None (the embedded SmolLM2 default), "smollm2-draft" (its packaged
    draft), a fetched model's name (`trtllm-dustin fetch-model`, trtllm_dustin/fetch.py), "preset:NAME" (random weights
    from `seed`), a checkpoint directory or a .gguf file. option: the command line option that named it, for the
    messages."""
    spec = spec or DEFAULT_MODEL
    if spec == DEFAULT_MODEL:
        return _open_gguf(default_gguf_path())
    if spec == DEFAULT_DRAFT:
        return _open_hf_dir(default_draft_path())
    if spec in FETCHABLE:
        return _open_gguf(fetched_path(spec))
    if spec.startswith("preset:"):
        return Checkpoint(get_preset(spec.split(":", 1)[1]), None, spec, f"random weights (seed {seed})", None, seed)
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return _open_hf_dir(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{option} {spec}: GGUF file {path} does not exist; pass an existing .gguf file, a "
                                 "checkpoint directory or preset:NAME")
        return _open_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"{option} {spec!r} is neither a preset (preset:NAME), a directory nor a .gguf file (no "
                             f"such path); pass one of them")
    raise ConfigError(f"{option} {spec!r}: unsupported file type; pass a checkpoint directory or a .gguf file")


def load_model(spec: str | None = None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, seed: int = 0, share_with: Transformer | None = None
               ) -> LoadedModel:
    """Open and load `spec` (the forms of `open_model`) on `device` in `dtype`.

    share_with: the target, for a draft checkpoint that takes its embedding and output matrix from it (the
    packaged draft does); ignored by checkpoints that carry their own.
    """
    return open_model(spec, seed).load(device, dtype, max_positions, share_with)
