"""The decode methods by name: each is a (Drafter, Selector) pair, which runtime/build.py assembles into a decoder.

One registry for every caller: the CLI (`generate --method`, `triton-repo --method`), the serving engine, the
quality evaluation and the benchmarks read METHODS. Production holds the offered methods only; the evaluation-only
ones (oracles, sweeps, variants that did not help) live in runtime/experimental/, which adds them here, not offered,
when the quality evaluation, a benchmark or a test imports it (production never does).

The budget k of the sparse-verification baselines is the Dustin config's (so that every sparse method of one run
compares at the same k), or MethodSetup.draft_budget when no Dustin config is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from trtllm_dustin.attention import AttentionBackend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.longspark import LongSpark
from trtllm_dustin.models.ring_drafter import RingDrafter
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Drafter
from trtllm_dustin.runtime.drafters import (
    DraftView,
    FullCacheView,
    LongSparkDrafter,
    ModelDrafter,
    NoDraft,
    StreamingWindowView,
    VerificationSetView,
)
from trtllm_dustin.runtime.drafters.ring import RingDrafting
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.selectors import (
    AdaptiveShare,
    DustinSelector,
    FullVerification,
    InPassSelector,
    QuestSelector,
    SnapKVSelector,
    StreamingLLMSelector,
)

__all__ = ["FULL_DRAFT", "METHODS", "OFFERED_METHODS", "DrafterFactory", "Method", "MethodSetup", "SelectorFactory",
           "baseline_budget", "dustin_longspark_selector", "dustin_selector", "in_pass_selector", "longspark_drafter",
           "longspark_lookahead", "method_spec", "model_drafter", "register_methods", "ring_drafter"]


@dataclass(frozen=True)
class MethodSetup:
    """What a method is built from; the draft fields are ignored by vanilla."""

    target: Transformer
    target_cache: KVCache
    backend: AttentionBackend
    draft: Transformer | None = None
    draft_cache: KVCache | None = None
    gamma: int = 3  # draft tokens per round
    draft_budget: int = 512  # MagicDec's StreamingLLM budget for the draft (and the baselines' k without a config)
    dustin: DustinConfig | None = None  # Dustin's searched estimator configuration
    longspark: LongSpark | None = None  # a LongSpark drafter attached to the target (the longspark methods)
    # Where the LongSpark drafter reads its target layers' K/V when target_cache does not hold them all (a pipeline's
    # first stage): target layer -> (K, V) [B, H_kv, S_max, D]; None: target_cache's layers
    longspark_kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    ring: RingDrafter | None = None  # a ring drafter attached to the target (the ring methods)
    use_cuda_graph: bool = True  # replay the round's fixed-shape phases from CUDA graphs (CUDA only)
    kernels: KernelConfig = field(default_factory=KernelConfig)  # given to both models; the graphs record it


DrafterFactory = Callable[[MethodSetup, PhaseGraphs], Drafter]
SelectorFactory = Callable[[MethodSetup, Drafter], Selector]


@dataclass(frozen=True)
class Method:
    drafter: DrafterFactory
    selector: SelectorFactory
    about: str  # one line for --help
    needs_draft: bool = True
    needs_dustin: bool = False  # needs a searched Dustin config (its SRH heads, or its budget for the draft)
    sparse: bool = False  # verifies against a selected set of k positions (the selector has a budget)
    offered: bool = True  # a user option (CLI, model repository); False: evaluation only (runtime/experimental/)
    needs_longspark: bool = False  # drafts with a LongSpark drafter (no draft model, no draft cache)
    eager_only: bool = False  # decides on the host round by round: build with use_cuda_graph=False (evaluation)
    needs_ring: bool = False  # drafts with a ring drafter (no draft model, no draft cache)

    @property
    def speculative(self) -> bool:
        """Proposes draft tokens (Γ > 0): every method but vanilla."""
        return self.needs_draft or self.needs_longspark or self.needs_ring


# ---- drafters --------------------------------------------------------------------------------------------------
def _no_draft(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return NoDraft(setup.target_cache.batch_slots, setup.target.config.vocab_size, setup.target_cache.seqlens.device)


def model_drafter(view: Callable[[MethodSetup], DraftView]) -> DrafterFactory:
    def build(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
        return ModelDrafter(setup.draft, setup.draft_cache, view(setup), setup.backend, setup.gamma,
                            setup.target.config.vocab_size, graphs, setup.kernels.round_kernels)
    return build


def longspark_drafter(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return LongSparkDrafter(setup.longspark, setup.target_cache, setup.gamma, graphs, setup.kernels.round_kernels,
                            setup.longspark_kv)


def ring_drafter(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return RingDrafting(setup.ring, setup.target_cache.batch_slots, setup.gamma, graphs, setup.kernels.round_kernels)


def _verification_set(setup: MethodSetup) -> DraftView:
    cache = setup.target_cache
    return VerificationSetView(setup.dustin.budget, setup.dustin.n_sink, setup.gamma, cache.batch_slots,
                               cache.seqlens.device)


# ---- selectors -------------------------------------------------------------------------------------------------
def _full(setup: MethodSetup, drafter: Drafter) -> Selector:
    return FullVerification()


def dustin_selector(variant: str, adaptive: bool = False, history_decay: float | None = None,
                    per_kv_head: bool = False) -> SelectorFactory:
    """Dustin-H/T/D (selectors/dustin.py). adaptive: m from the draft's confidence (AdaptiveShare); history_decay:
    S_target summed over rounds; per_kv_head: a set per KV head (the last three: evaluation only)."""
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        setup.dustin.check_models(setup.target.config, setup.draft.config)
        config = setup.dustin.variant(variant)
        lookahead = drafter.lookahead([lh.layer for lh in config.draft_layers], confidence=adaptive)
        share = AdaptiveShare(lookahead.confidence, config.budget - config.n_sink - config.n_recent) \
            if adaptive else None
        return DustinSelector(config, setup.target_cache, setup.target.config, setup.target.embed.weight.dtype,
                              lookahead, share, pdl=setup.kernels.pdl, history_decay=history_decay,
                              per_kv_head=per_kv_head)
    return build


def in_pass_selector(pages: bool = False, lookahead_share: float | None = None, dense: bool = False
                     ) -> SelectorFactory:
    """In-pass selection (selectors/in_pass.py) at the config's selection layers. pages: Quest-style page bounds
    instead of exact scores; lookahead_share: m as this share of the free slots instead of the config's selection_m;
    dense: the layers before the first selection layer verify in full (TidalDecode's dense layers)."""
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        config = setup.dustin
        config.check_models(setup.target.config, None)
        free = config.budget - config.n_sink - config.n_recent
        m = config.selection_m if lookahead_share is None else round(lookahead_share * free)
        if m > 0 and setup.draft is None:
            raise ConfigError("in-pass selection with a lookahead share needs a draft model's lookahead")
        lookahead = drafter.lookahead([lh.layer for lh in config.draft_layers]) if m > 0 else None
        dense_layers = config.selection_layers[0].layer if dense and config.selection_layers else None
        return InPassSelector(config, setup.target_cache, setup.target.config, lookahead, pages=pages, m=m,
                              dense_layers=dense_layers, pdl=setup.kernels.pdl)
    return build


def dustin_longspark_selector(variant: str) -> SelectorFactory:
    """Dustin over a LongSpark draft: S_draft scores the LongSpark blocks' queries of the proposed positions against
    the target's own keys of the block's layer (the blocks attend in that layer's key space), with the SRH heads the
    search chose for that target layer; S_target as in Dustin. No draft KV is read."""
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        base = setup.dustin
        base.check_models(setup.target.config, None)
        # A pipeline's first stage passes the config already on the LongSpark blocks and without its SRH target
        # layers (their S_target is scored on the stages that hold them: runtime/pipeline/selection.py).
        config = (longspark_lookahead(base, setup.longspark.config.target_layers, variant) if base.target_layers
                  else base).variant(variant)
        lookahead = drafter.lookahead([lh.layer for lh in config.draft_layers])
        return DustinSelector(config, setup.target_cache, setup.target.config, setup.target.embed.weight.dtype,
                              lookahead, pdl=setup.kernels.pdl)
    return build


def longspark_lookahead(base: DustinConfig, reads: Sequence[int], variant: str) -> DustinConfig:
    """The Dustin config over a LongSpark draft that reads target layers `reads`: its draft layers are the LongSpark
    blocks of the SRH target layers it reads (block j reads reads[j]), each with that layer's heads."""
    reads = tuple(reads)
    blocks = tuple(LayerHeads(reads.index(lh.layer), lh.heads) for lh in base.target_layers if lh.layer in reads)
    if not blocks and variant != "t":
        raise ConfigError(f"the LongSpark drafter reads target layers {list(reads)}, none of the Dustin config's "
                          f"SRH layers {[lh.layer for lh in base.target_layers]}; its lookahead cannot be scored")
    return replace(base, draft_layers=blocks, draft_fingerprint="")


def baseline_budget(setup: MethodSetup) -> tuple[int, int]:
    """(k, n_sink) of a baseline: the Dustin config's, else the draft budget with 4 sinks."""
    return (setup.dustin.budget, setup.dustin.n_sink) if setup.dustin is not None else (setup.draft_budget, 4)


def _streamingllm(setup: MethodSetup, drafter: Drafter) -> Selector:
    cache = setup.target_cache
    return StreamingLLMSelector(*baseline_budget(setup), cache.batch_slots, cache.seqlens.device)


def _snapkv(setup: MethodSetup, drafter: Drafter) -> Selector:
    return SnapKVSelector(*baseline_budget(setup), setup.target, setup.target_cache, setup.backend)


def _quest(setup: MethodSetup, drafter: Drafter) -> Selector:
    return QuestSelector(*baseline_budget(setup), setup.target_cache, setup.target.config,
                         setup.target.embed.weight.dtype)


FULL_DRAFT = model_drafter(lambda s: FullCacheView())
METHODS: dict[str, Method] = {
    "vanilla": Method(_no_draft, _full, "plain decoding, one token per step", needs_draft=False),
    "classic": Method(FULL_DRAFT, _full, "Classic SD: full-cache draft, full verification"),
    "magicdec": Method(model_drafter(lambda s: StreamingWindowView(s.draft_budget)), _full,
                       "MagicDec: StreamingLLM-window draft (--draft-budget), full verification"),
    "dustin-h": Method(FULL_DRAFT, dustin_selector("h"), "Dustin-H: sparse verification, Eq. 6 hybrid set",
                       needs_dustin=True, sparse=True),
    "dustin-t": Method(FULL_DRAFT, dustin_selector("t"), "Dustin-T: sparse verification by the target's history",
                       needs_dustin=True, sparse=True),
    "dustin-d": Method(FULL_DRAFT, dustin_selector("d"), "Dustin-D: sparse verification by the draft's lookahead",
                       needs_dustin=True, sparse=True),
    "dustin-h-sparse-draft": Method(model_drafter(_verification_set), dustin_selector("h"),
                                    "Dustin-H whose draft also reads only the verification set", needs_dustin=True,
                                    sparse=True),
    "streamingllm": Method(FULL_DRAFT, _streamingllm, "sparse verification by StreamingLLM's set (baseline)",
                           sparse=True),
    "snapkv": Method(FULL_DRAFT, _snapkv, "sparse verification by SnapKV's prompt-time set (baseline)",
                     sparse=True),
    "quest": Method(FULL_DRAFT, _quest, "sparse verification by Quest's page bounds (baseline)", sparse=True),
    # In-pass selection (issue 35): the verification pass picks its set from its own queries at the selection layers.
    "dustin-ip": Method(FULL_DRAFT, in_pass_selector(), "in-pass selection: the verification queries pick the set "
                        "at the searched selection layers", needs_dustin=True, sparse=True),
    "dustin-ip-pages": Method(FULL_DRAFT, in_pass_selector(pages=True), "in-pass selection by page bounds (Quest "
                              "style) of the verification queries", needs_dustin=True, sparse=True),
    "dustin-ip-sparse-draft": Method(model_drafter(_verification_set), in_pass_selector(),
                                     "in-pass selection whose draft also reads only the set", needs_dustin=True,
                                     sparse=True),
    "longspark": Method(longspark_drafter, _full, "LongSpark: fixed-cost block-parallel draft (--longspark), full "
                        "verification", needs_draft=False, needs_longspark=True),
    "dustin-t-longspark": Method(longspark_drafter, dustin_longspark_selector("t"), "LongSpark draft, Dustin-T "
                                 "sparse verification (the target's history picks the set)", needs_draft=False,
                                 needs_longspark=True, needs_dustin=True, sparse=True),
    "dustin-ip-longspark": Method(longspark_drafter, in_pass_selector(), "LongSpark draft, in-pass selection",
                                  needs_draft=False, needs_longspark=True, needs_dustin=True, sparse=True),
    # The ring drafter (issue 38): own layers over a ring of the last W positions, fed the target's hidden states.
    "ring": Method(ring_drafter, _full, "the ring drafter (own layers over a ring of recent positions, fixed cost; "
                   "--ring), full verification", needs_draft=False, needs_ring=True),
    "dustin-ip-ring": Method(ring_drafter, in_pass_selector(), "the ring drafter (--ring), in-pass selection",
                             needs_draft=False, needs_ring=True, needs_dustin=True, sparse=True),
}
OFFERED_METHODS = tuple(name for name, method in METHODS.items() if method.offered)


def register_methods(methods: Mapping[str, Method]) -> None:
    """Add evaluation-only methods to METHODS (runtime/experimental/ does, when imported). They are never offered:
    the CLI's and the model repository's choices stay OFFERED_METHODS."""
    taken = sorted(set(methods) & set(METHODS))
    if taken:
        raise ValueError(f"methods {taken} are registered already")
    offered = sorted(name for name, method in methods.items() if method.offered)
    if offered:
        raise ValueError(f"methods {offered} are offered; an evaluation-only method takes offered=False")
    METHODS.update(methods)


def method_spec(name: str) -> Method:
    """The registry entry of `name`, or a ConfigError naming the offered methods."""
    if name not in METHODS:
        raise ConfigError(f"method {name!r} is unknown; choose one of {', '.join(OFFERED_METHODS)}")
    return METHODS[name]
