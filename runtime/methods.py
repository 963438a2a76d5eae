"""The decode methods by name: one registry instead of `if method == ...` chains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trtllm_dustin.attention import AttentionBackend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.runtime.baselines import BASELINE_METHODS, EVALUATION_METHODS
from trtllm_dustin.runtime.classic import ClassicSD
from trtllm_dustin.runtime.dustin import Dustin
from trtllm_dustin.runtime.dustin_sparse_draft import DustinSparseDraft
from trtllm_dustin.runtime.magicdec import MagicDec
from trtllm_dustin.runtime.speculative import SpeculativeDecoder
from trtllm_dustin.runtime.vanilla import VanillaDecoder

__all__ = ["METHODS", "MethodSetup", "build_decoder"]


@dataclass(frozen=True)
class MethodSetup:
    """What a method is built from; the draft fields are ignored by vanilla."""

    target: Transformer
    target_cache: KVCache
    backend: AttentionBackend
    draft: Transformer | None = None
    draft_cache: KVCache | None = None
    gamma: int = 3  # draft tokens per round
    draft_budget: int = 512  # MagicDec's StreamingLLM budget for the draft
    dustin: DustinConfig | None = None  # Dustin's searched estimator configuration
    use_cuda_graph: bool = True


def _speculative(setup: MethodSetup, cls: type[SpeculativeDecoder], **extra) -> SpeculativeDecoder:
    if setup.draft is None or setup.draft_cache is None:
        raise ConfigError(f"method {cls.name} needs a draft model; pass --draft DIR|FILE.gguf|preset:NAME")
    return cls(setup.target, setup.draft, setup.target_cache, setup.draft_cache, setup.backend, gamma=setup.gamma,
               use_cuda_graph=setup.use_cuda_graph, **extra)


def _dustin(variant: str, cls: type[Dustin] = Dustin) -> Callable[[MethodSetup], SpeculativeDecoder]:
    def build(setup: MethodSetup) -> SpeculativeDecoder:
        if setup.dustin is None:
            raise ConfigError(f"dustin-{variant} needs a Dustin configuration (SRH layers/heads, budget, m); pass "
                              "--dustin-config FILE, written by `trtllm-dustin search` for this target/draft pair")
        return _speculative(setup, cls, dustin=setup.dustin, variant=variant)
    return build


METHODS: dict[str, Callable[[MethodSetup], VanillaDecoder | SpeculativeDecoder]] = {
    "vanilla": lambda s: VanillaDecoder(s.target, s.target_cache, s.backend, use_cuda_graph=s.use_cuda_graph),
    "classic": lambda s: _speculative(s, ClassicSD),
    "magicdec": lambda s: _speculative(s, MagicDec, draft_budget=s.draft_budget),
    "dustin-h": _dustin("h"),
    "dustin-t": _dustin("t"),
    "dustin-d": _dustin("d"),
    "dustin-h-sparse-draft": _dustin("h", DustinSparseDraft),
    **BASELINE_METHODS,  # streamingllm, snapkv, quest (sparse-verification baselines)
}


def build_decoder(method: str, setup: MethodSetup) -> VanillaDecoder | SpeculativeDecoder:
    """A decoder for one of METHODS (the user-facing choices), or for an evaluation-only method (EVALUATION_METHODS:
    measured by benchmarks/eval_quality.py, not offered as an option because it did not help)."""
    if method in EVALUATION_METHODS:
        return EVALUATION_METHODS[method](setup)
    if method not in METHODS:
        raise ConfigError(f"method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    return METHODS[method](setup)
