"""Where the tests run and the tiny models they build: the devices, a tiny Hugging Face checkpoint made with
`transformers`, the registry's vanilla decoder over a model."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["DEVICES", "fetched", "tiny_hf_model", "vanilla_decoder"]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def vanilla_decoder(model, cache, backend: str = "reference", use_cuda_graph: bool = True):
    """The registry's vanilla method (no draft, full verification) over `model` and its cache."""
    from trtllm_dustin.attention import get_backend
    from trtllm_dustin.runtime.build import build_decoder
    from trtllm_dustin.runtime.methods import MethodSetup

    return build_decoder("vanilla", MethodSetup(target=model, target_cache=cache, backend=get_backend(backend),
                                                use_cuda_graph=use_cuda_graph))


def tiny_hf_model(arch: str, seed: int = 0):
    """A tiny random LlamaForCausalLM (llama3 rope scaling) or Qwen2ForCausalLM (YaRN, tied, qkv bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=160, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    if arch == "llama":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "rope_theta": 500000.0})
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(config)
    # Random init draws small weights; scale them up so logits are far from uniform and argmax ties vanish.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    return model.eval()


def fetched(name: str) -> Path | None:
    """The GGUF of a fetchable model where `trtllm-dustin fetch-model` has put it, else None (CI never fetches)."""
    from trtllm_dustin.fetch import fetched_path
    from trtllm_dustin.models.errors import ModelLoadError

    try:
        return fetched_path(name)
    except ModelLoadError:
        return None
