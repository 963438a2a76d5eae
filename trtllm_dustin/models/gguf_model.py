"""A GGUF file as one of our decoders: the ModelConfig from its metadata, its tensors under Hugging Face names.

llama.cpp names tensors `token_embd`, `blk.N.attn_q`, ... and keys `<arch>.block_count`, ...; the HF names let the
loader reuse one name map (`loading._hf_names`) and its checks for both formats. Its converter permutes the rows
of a `llama` file's attn_q / attn_k (weights and biases) from Hugging Face's rotate-half rotary layout to ggml's
interleaved one, per head: row (h, i, j) <- row (h, j, i) for i < 2, j < D / 2. `hf_tensors` undoes it, so the
tensors equal what the Hugging Face checkpoint holds; qwen2 files are written unpermuted.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from trtllm_dustin.config import ModelConfig, RopeScaling
from trtllm_dustin.models.errors import ModelLoadError
from trtllm_dustin.models.gguf import GGUFFile

__all__ = ["GGUF_ARCHITECTURES", "gguf_config", "hf_tensors", "hf_name"]

GGUF_ARCHITECTURES = ("llama", "qwen2")  # general.architecture values we build; qwen2 has q/k/v biases
_PERMUTED = ("llama",)  # architectures whose attn_q / attn_k rows llama.cpp permutes for its rotary layout
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}  # <arch>.rope.scaling.type -> ours


def _architecture(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (Llama 3.x, SmolLM2, Qwen2.5)")
    return arch


def _key(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    value = gguf.metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"{gguf.path} has no metadata key {key!r}; the file is incomplete (re-convert it)")
    return value


def gguf_config(gguf: GGUFFile, name: str) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes (the one `ModelConfig.from_hf` builds from the original
    config.json), with tied embeddings when the file holds no `output.weight`."""
    arch = _architecture(gguf)
    a = f"{arch}."
    hidden, heads = _key(gguf, a + "embedding_length"), _key(gguf, a + "attention.head_count")
    head_dim = gguf.metadata.get(a + "attention.key_length", hidden // heads)
    rotary = gguf.metadata.get(a + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(f"{gguf.path}: rotary dims {rotary} != head_dim {head_dim}; partial rotary embeddings "
                             "are not supported")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf.path} has no token_embd.weight; the file is incomplete")
    vocab = gguf.metadata.get(a + "vocab_size", embed.shape[0])
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.path} scales its rotary frequencies by a rope_freqs tensor (Llama 3.1 style), "
                             "which this loader does not read; load the Hugging Face checkpoint directory instead")
    eos = gguf.metadata.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            name=name, vocab_size=vocab, hidden_size=hidden, num_layers=_key(gguf, a + "block_count"),
            num_heads=heads, num_kv_heads=gguf.metadata.get(a + "attention.head_count_kv", heads), head_dim=head_dim,
            intermediate_size=_key(gguf, a + "feed_forward_length"),
            rms_norm_eps=float(_key(gguf, a + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf.metadata.get(a + "rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(gguf, a),
            max_position_embeddings=_key(gguf, a + "context_length"),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in gguf.tensors,
            bos_token_id=gguf.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,))
    except (TypeError, ValueError) as e:  # ConfigError is a ValueError: name the file
        raise ModelLoadError(f"{gguf.path}: its metadata describes no valid model ({e})") from e


def _rope_scaling(gguf: GGUFFile, a: str) -> RopeScaling:
    kind = gguf.metadata.get(a + "rope.scaling.type", "none")
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(f"{gguf.path}: rope scaling {kind!r} is not supported; supported: "
                             f"{', '.join(_ROPE_TYPES)}")
    if kind == "none":
        return RopeScaling()
    values = {"factor": gguf.metadata.get(a + "rope.scaling.factor"),
              "original_max_position_embeddings": gguf.metadata.get(a + "rope.scaling.original_context_length"),
              "beta_fast": gguf.metadata.get(a + "rope.scaling.yarn_beta_fast"),
              "beta_slow": gguf.metadata.get(a + "rope.scaling.yarn_beta_slow")}
    return RopeScaling(rope_type=_ROPE_TYPES[kind], **{k: v for k, v in values.items() if v is not None})


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name (`blk.3.attn_q.bias` -> `model.layers.3.self_attn.q_proj.bias`);
    names outside the map are returned as they are, for the loader to refuse by name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{suffix}"
    return gguf_name


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q or k projection (weight [H*D, C] or bias [H*D])."""
    rows = t.shape[0]
    # ggml rows (h, j, i) with j < D/2, i < 2 back to HF rows (h, i, j)
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def hf_tensors(gguf: GGUFFile, config: ModelConfig, workers: int | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, in file order.

    Dequantizing is numpy work that releases the GIL, so `workers` threads (None: up to 8, one per core) dequantize
    the next tensors while the caller copies the current one; at most two per worker are held at once."""
    permuted = _architecture(gguf) in _PERMUTED

    def one(name: str) -> tuple[str, torch.Tensor]:
        tensor = gguf.tensor(name)
        if permuted and ".attn_q." in name:
            tensor = _unpermute(tensor, config.num_heads)
        elif permuted and ".attn_k." in name:
            tensor = _unpermute(tensor, config.num_kv_heads)
        return hf_name(name), tensor

    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1:
        yield from map(one, gguf.tensors)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for name in gguf.tensors:
            pending.append(pool.submit(one, name))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
