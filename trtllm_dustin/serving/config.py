"""What a served model is built from: one frozen dataclass, written into the repository as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS
from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS
from trtllm_dustin.validation import DEFAULT_PREFILL_BUDGET, load_versioned, versioned_json

__all__ = ["DEFAULT_PREFILL_BUDGET", "SERVING_SCHEMA_VERSION", "ServingConfig"]

SERVING_SCHEMA_VERSION = 1
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServingConfig:
    """One Triton model instance: the models it loads, the methods it serves and its batching limits."""

    model: str | None = None  # checkpoint dir, .gguf file or preset:NAME; None = the embedded SmolLM2 default
    engine: str | None = None  # an engine directory (`trtllm-dustin build`): its models, configs, dtype, tactics
    draft: str | None = None  # draft model (same forms); needed by the draft-model methods
    longspark: str | None = None  # LongSpark drafter dir or "random"; None = the packaged one (default model only)
    ring: str | None = None  # ring drafter dir or "random"; None = the packaged one (default model only)
    methods: tuple[str, ...] = ("vanilla",)  # methods served; each keeps its own KV caches (memory x methods)
    default_method: str = ""  # used when a request names none; "" = the first of `methods`
    dustin: DustinConfig | None = None  # Dustin's searched estimator configuration (dustin-* methods)
    max_batch: int = 8  # batch slots per method: requests decoded together (in-flight)
    max_seq_len: int = 4096  # KV cache length per slot: prompt + max_tokens (+ gamma) must fit
    queue_size: int = 64  # requests waiting for a slot; more are refused with an error, not queued
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str | None = None  # weights and caches; None = bfloat16 on cuda, float32 on cpu
    backend: str | None = None  # attention backend; None = triton on cuda, reference on cpu
    gamma: int = 3  # draft tokens per speculative round
    draft_budget: int = 512  # MagicDec: the draft's StreamingLLM KV budget
    draft_kv_cache: str = "model"  # the draft's KV cache: "model" (its dtype) or "fp8" (e4m3, half the reads)
    draft_weights: str = "model"  # the draft's (and ring drafter's) layers: "model" (its dtype) or "int8" (weight-only,
    # half the reads)
    use_cuda_graph: bool = True  # replay captured decode phases on cuda
    prefill_chunk: int = 2048  # prompt tokens per prefill forward
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET  # prompt tokens prefilled per scheduler step, over the
    # waiting requests oldest first (the chunks of several in one forward), beside the decode round of the running
    # ones; 0 (or null) = one chunk per step, and a prompt of one chunk prefilled alone at its admission
    prefix_cache_mib: int = 0  # per method: K/V of prompt prefixes kept for reuse (LRU); 0 = no prefix caching
    prefix_block: int = 256  # prefix caching's granularity: prompts share cached K/V in whole blocks of this many
    decoupled: bool = True  # Triton's decoupled transaction policy: streaming and in-flight batching
    weights_seed: int = 0  # random-weight presets: the target's seed (the draft's and a random LongSpark drafter's
    # weights_seed + 1, a random ring drafter's + 2), as the CLI
    chat_template: bool = False  # wrap text_input in the tokenizer's chat template before encoding
    request_timeout_s: float = 600.0  # non-decoupled mode: longest a request may take before it is answered with
    # an error (bounds the execute() call that waits for it)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept with the repository (provenance)

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", tuple(self.methods))
        if isinstance(self.dustin, dict):
            object.__setattr__(self, "dustin", DustinConfig(**self.dustin))
        if not self.methods:
            raise ConfigError("serve at least one method; pass --method NAME")
        unknown = [m for m in self.methods if m not in OFFERED_METHODS]
        if unknown:
            raise ConfigError(f"method(s) {unknown} are unknown; choose from {', '.join(OFFERED_METHODS)}")
        if self.default_method and self.default_method not in self.methods:
            raise ConfigError(f"default method {self.default_method!r} is not among the served {self.methods}")
        if self.engine is not None:
            given = [name for name in ("model", "draft", "longspark", "ring", "dustin")
                     if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"--engine brings its own models and configs; drop --{given[0]}")
            self._check_limits()
            return
        needing = [m for m in self.methods if METHODS[m].needs_longspark]
        if needing and self.longspark is None and self.model is not None:
            raise ConfigError(f"methods {needing} need --longspark DIR (from `trtllm-dustin train-longspark`) or "
                              "--longspark random; only the default model has a packaged one")
        needing = [m for m in self.methods if METHODS[m].needs_ring]
        if needing and self.ring is None and self.model is not None:
            raise ConfigError(f"methods {needing} need --ring DIR (from `trtllm-dustin train-ring-drafter`) or --ring "
                              "random; only the default model has a packaged one")
        if any(METHODS[m].needs_draft for m in self.methods) and self.draft is None:
            raise ConfigError(f"speculative methods {self.methods} need a draft model; pass --draft "
                              "DIR|FILE.gguf|preset:NAME")
        if any(METHODS[m].needs_dustin for m in self.methods) and self.dustin is None:
            needing = [m for m in self.methods if METHODS[m].needs_dustin]
            raise ConfigError(f"methods {needing} need --dustin-config FILE (written by `trtllm-dustin search`)")
        self._check_limits()

    def _check_limits(self) -> None:
        for name in ("max_batch", "max_seq_len", "queue_size", "gamma", "prefill_chunk", "prefix_block"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.prefill_budget is not None and self.prefill_budget < 0:
            raise ConfigError(f"prefill_budget={self.prefill_budget} must be >= 1, or 0 for one chunk per step")
        if self.prefix_cache_mib < 0:
            raise ConfigError(f"prefix_cache_mib={self.prefix_cache_mib} must be >= 0 (0: no prefix caching)")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or cuda:N")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} must be one of {_DTYPES}")
        if self.draft_kv_cache not in DRAFT_KV_CHOICES:
            raise ConfigError(f"draft_kv_cache {self.draft_kv_cache!r} must be 'model' or 'fp8'")
        if self.draft_weights not in DRAFTER_WEIGHTS:
            raise ConfigError(f"draft_weights {self.draft_weights!r} must be 'model' or 'int8' (int8: the draft's "
                              "layers in weight-only int8)")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s={self.request_timeout_s} must be > 0")

    @property
    def method(self) -> str:
        """The method used when a request names none."""
        return self.default_method or self.methods[0]

    def with_(self, **changes: Any) -> ServingConfig:
        return replace(self, **changes)

    def to_json(self) -> str:
        return versioned_json(SERVING_SCHEMA_VERSION, asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "the serving config") -> ServingConfig:
        """source: what the message calls the text (load: the file)."""
        return load_versioned(cls, text, (SERVING_SCHEMA_VERSION,), source,
                              "regenerate the repository with `trtllm-dustin triton-repo`")

    @classmethod
    def load(cls, path: str | Path) -> ServingConfig:
        return cls.from_json(Path(path).read_text(), f"serving config {path}")
