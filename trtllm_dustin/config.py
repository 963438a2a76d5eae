"""Model configuration: one frozen dataclass for every decoder of the family (Llama 3.x, Qwen2.5, SmolLM2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trtllm_dustin.errors import ConfigError
from trtllm_dustin.validation import read_versioned, versioned_json

__all__ = ["SCHEMA_VERSION", "ConfigError", "ModelConfig", "RopeScaling"]

SCHEMA_VERSION = 1

ROPE_TYPES = ("default", "llama3", "yarn", "linear")
HF_HEAD_KEY = "dustin_head_vocab_size"  # our key in a checkpoint's config.json: rows of a subset output head


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding scaling, as Hugging Face configs describe it."""

    rope_type: str = "default"  # "default" | "llama3" | "yarn" | "linear"
    factor: float = 1.0  # context extension factor (llama3: x8 for 3.1-8B, x32 for 3.2-1B; Qwen YaRN: 4 for 128K)
    original_max_position_embeddings: int = 8192  # pretraining context that the scaling extends
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    beta_fast: float = 32.0  # YaRN: rotations per context above which a dimension is kept (extrapolated)
    beta_slow: float = 1.0  # YaRN: rotations per context below which a dimension is fully interpolated
    attention_factor: float | None = None  # YaRN: logit temperature; None means 0.1 * ln(factor) + 1

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_type {self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor {self.factor} must be > 0")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling:
        """Build from a Hugging Face `rope_scaling` / `rope_parameters` dict (None means no scaling)."""
        if not params:
            return cls()
        rope_type = params.get("rope_type", params.get("type", "default"))
        known = {f for f in cls.__dataclass_fields__ if f != "rope_type"}
        values = {k: v for k, v in params.items() if k in known and v is not None}
        return cls(rope_type=rope_type, **values)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only transformer."""

    name: str = "custom"  # preset or checkpoint name, for messages and result files
    vocab_size: int = 32000  # rows of the embedding and output matrices
    hidden_size: int = 4096  # model width
    num_layers: int = 32  # decoder blocks
    num_heads: int = 32  # query heads
    num_kv_heads: int = 8  # key/value heads (GQA: num_heads must be a multiple)
    head_dim: int = 128  # per-head width (not always hidden/heads)
    intermediate_size: int = 14336  # SwiGLU width
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 500000.0  # rotary base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # context extension
    max_position_embeddings: int = 131072  # longest position the checkpoint supports
    tie_word_embeddings: bool = False  # output matrix is the embedding matrix (SmolLM2, Llama-3.2-1B, Qwen-0.5B)
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v projections
    bos_token_id: int | None = None  # prepended by the tokenizer, if any
    eos_token_ids: tuple[int, ...] = ()  # generation stops on any of these
    # A draft may predict only the `head_vocab_size` most frequent ids of the vocabulary (its output matrix has that
    # many rows; the model's `head_ids` buffer maps them to vocabulary ids; every other id gets -inf). 0: all ids.
    head_vocab_size: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; GQA needs it")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not isinstance(self.head_vocab_size, int) or not 0 <= self.head_vocab_size < self.vocab_size:
            raise ConfigError(f"head_vocab_size={self.head_vocab_size!r} must be 0 (all ids) or in "
                              f"[1, vocab_size={self.vocab_size})")
        if self.head_vocab_size and self.tie_word_embeddings:
            raise ConfigError("head_vocab_size > 0 needs its own output matrix: set tie_word_embeddings=False")
        if isinstance(self.rope_scaling, dict):  # from JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def layer_parameters(self) -> int:
        """Parameters of one decoder block (attention, SwiGLU, two norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * h * self.intermediate_size + 2 * h

    def output_rows(self) -> int:
        """Rows of the output matrix: the vocabulary, or the subset a draft's head predicts."""
        return self.head_vocab_size or self.vocab_size

    def num_parameters(self) -> int:
        """Parameter count (input embedding, blocks, final norm, a separate output matrix), for memory estimates."""
        output = 0 if self.tie_word_embeddings else self.output_rows()
        return self.num_layers * self.layer_parameters() + (self.vocab_size + output) * self.hidden_size + \
            self.hidden_size

    def weight_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Weight bytes one decode step reads: every block, the final norm and the output matrix (the input embedding
        is a row lookup, negligible)."""
        return (self.num_layers * self.layer_parameters() + (self.output_rows() + 1) * self.hidden_size) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V bytes of one cached token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def to_json(self) -> str:
        return versioned_json(SCHEMA_VERSION, asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = read_versioned(text, (SCHEMA_VERSION,), "model config", "rebuild the config")
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf_config: Any, name: str = "custom") -> ModelConfig:
        """Build from a `transformers` PretrainedConfig of a Llama or Qwen2 model."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in ("llama", "qwen2"):
            raise ConfigError(
                f"architecture {model_type!r} is not supported; supported: 'llama' (Llama 3.x, SmolLM2), 'qwen2'")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope_params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        eos = hf_config.eos_token_id
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        if model_type == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(getattr(hf_config, "attention_bias", False))
            if getattr(hf_config, "mlp_bias", False):
                raise ConfigError("Llama checkpoints with mlp_bias=True are not supported")
        return cls(
            name=name,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope_params),
            max_position_embeddings=hf_config.max_position_embeddings,
            head_vocab_size=int(getattr(hf_config, HF_HEAD_KEY, 0) or 0),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
