"""Model shapes of the paper's target/draft pairs (from their published configs) and tiny shapes for tests.

Presets are loaded with random weights: a decode step costs the same whatever the values, so speed
is measured on these while real weights cannot be had on the project's machines.
"""

from __future__ import annotations

from trtllm_dustin.config import ModelConfig, RopeScaling

__all__ = ["PRESETS", "get_preset"]

_LLAMA_EOS = (128001, 128008, 128009)
_QWEN_EOS = (151645, 151643)
# Qwen2.5 past 32K: YaRN x2 over the 32768-token pretraining window, as the paper (App. C) and Qwen document.
_QWEN_YARN = RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=32768)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, head_dim: int, ffn: int, tied: bool,
           factor: float) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=128256, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, intermediate_size=ffn, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=factor, original_max_position_embeddings=8192,
                                 low_freq_factor=1.0, high_freq_factor=4.0),
        max_position_embeddings=131072, tie_word_embeddings=tied, bos_token_id=128000, eos_token_ids=_LLAMA_EOS)


def _qwen(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool,
          head_dim: int = 128) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, intermediate_size=ffn, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=_QWEN_YARN,
        max_position_embeddings=65536, tie_word_embeddings=tied, qkv_bias=True, eos_token_ids=_QWEN_EOS)


PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, tied=False, factor=8.0),
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, tied=True, factor=32.0),
    "llama-3.3-70b": _llama("llama-3.3-70b", 80, 8192, 64, 8, 128, 28672, tied=False, factor=8.0),
    "qwen2.5-0.5b": _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True, head_dim=64),
    "qwen2.5-7b": _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, tied=False),
    "qwen2.5-14b": _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, tied=False),
    "qwen2.5-32b": _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, tied=False),
    "qwen2.5-72b": _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, tied=False),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # A random-weight draft with SmolLM2's vocabulary, until the project's trained draft exists (runtime tests).
    "smollm2-draft-random": ModelConfig(
        name="smollm2-draft-random", vocab_size=49152, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=512, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # Tiny shapes for tests: odd sizes and a GQA ratio of 3 catch layout bugs that square shapes hide.
    "tiny-llama": ModelConfig(
        name="tiny-llama", vocab_size=257, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
        intermediate_size=160, rope_theta=10000.0, max_position_embeddings=2048, eos_token_ids=(1,)),
    "tiny-llama-draft": ModelConfig(  # a smaller model with tiny-llama's vocabulary, as a draft in tests
        name="tiny-llama-draft", vocab_size=257, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=96, rope_theta=10000.0, max_position_embeddings=2048, eos_token_ids=(1,)),
    "tiny-qwen": ModelConfig(
        name="tiny-qwen", vocab_size=263, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
        intermediate_size=112, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048,
        qkv_bias=True, tie_word_embeddings=True, eos_token_ids=(1,)),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
