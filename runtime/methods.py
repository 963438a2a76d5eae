"""The decode methods by name: each is a (Drafter, Selector) pair, built by `build_decoder`.

One registry for every caller: the CLI (`generate --method`, `triton-repo --method`), the serving engine, the
quality evaluation and the benchmarks read METHODS; `offered` marks the user-facing ones (an evaluation-only method
is measured by benchmarks/eval_quality.py but not offered, because it did not help).

The budget k of the sparse-verification baselines is the Dustin config's (so that every sparse method of one run
compares at the same k), or MethodSetup.draft_budget when no Dustin config is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from trtllm_dustin.attention import AttentionBackend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.longspark import LongSpark
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.decoder import Decoder
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
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.selectors import (
    AdaptiveShare,
    DustinSelector,
    FullVerification,
    InPassSelector,
    OracleSelector,
    PeriodicFullVerification,
    QuestSelector,
    SnapKVSelector,
    StreamingLLMSelector,
)

__all__ = ["METHODS", "OFFERED_METHODS", "Method", "MethodSetup", "build_decoder"]


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
    offered: bool = True  # a user option (CLI, model repository); False: evaluation only
    needs_longspark: bool = False  # drafts with a LongSpark drafter (no draft model, no draft cache)
    eager_only: bool = False  # decides on the host round by round: build with use_cuda_graph=False (evaluation)

    @property
    def speculative(self) -> bool:
        """Proposes draft tokens (Γ > 0): every method but vanilla."""
        return self.needs_draft or self.needs_longspark


# ---- drafters --------------------------------------------------------------------------------------------------
def _no_draft(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return NoDraft(setup.target_cache.batch_slots, setup.target.config.vocab_size, setup.target_cache.seqlens.device)


def _model_drafter(view: Callable[[MethodSetup], DraftView]) -> DrafterFactory:
    def build(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
        return ModelDrafter(setup.draft, setup.draft_cache, view(setup), setup.backend, setup.gamma,
                            setup.target.config.vocab_size, graphs, setup.kernels.round_kernels)
    return build


def _longspark(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return LongSparkDrafter(setup.longspark, setup.target_cache, setup.gamma, graphs, setup.kernels.round_kernels)


def _verification_set(setup: MethodSetup) -> DraftView:
    cache = setup.target_cache
    return VerificationSetView(setup.dustin.budget, setup.dustin.n_sink, setup.gamma, cache.batch_slots,
                               cache.seqlens.device)


# ---- selectors -------------------------------------------------------------------------------------------------
def _full(setup: MethodSetup, drafter: Drafter) -> Selector:
    return FullVerification()


def _dustin(variant: str, adaptive: bool = False, history_decay: float | None = None,
            per_kv_head: bool = False) -> SelectorFactory:
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


def _periodic(every: int) -> SelectorFactory:
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        return PeriodicFullVerification(_dustin("h")(setup, drafter), every)
    return build


def _oracle(kind: str) -> SelectorFactory:
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        return OracleSelector(kind, _budget(setup)[0], setup.target, setup.target_cache, setup.backend,
                              drafter.tokens)
    return build


def _in_pass(pages: bool = False, lookahead_share: float | None = None, dense: bool = False) -> SelectorFactory:
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


def _dustin_longspark(variant: str) -> SelectorFactory:
    """Dustin over a LongSpark draft: S_draft scores the LongSpark blocks' queries of the proposed positions against
    the target's own keys of the block's layer (the blocks attend in that layer's key space), with the SRH heads the
    search chose for that target layer; S_target as in Dustin. No draft KV is read."""
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        base = setup.dustin
        base.check_models(setup.target.config, None)
        reads = setup.longspark.config.target_layers
        blocks = tuple(LayerHeads(reads.index(lh.layer), lh.heads) for lh in base.target_layers if lh.layer in reads)
        if not blocks and variant != "t":
            raise ConfigError(f"the LongSpark drafter reads target layers {list(reads)}, none of the Dustin config's "
                              f"SRH layers {[lh.layer for lh in base.target_layers]}; its lookahead cannot be scored")
        config = replace(base, draft_layers=blocks, draft_fingerprint="").variant(variant)
        lookahead = drafter.lookahead([lh.layer for lh in config.draft_layers])
        return DustinSelector(config, setup.target_cache, setup.target.config, setup.target.embed.weight.dtype,
                              lookahead, pdl=setup.kernels.pdl)
    return build


def _budget(setup: MethodSetup) -> tuple[int, int]:
    """(k, n_sink) of a baseline: the Dustin config's, else the draft budget with 4 sinks."""
    return (setup.dustin.budget, setup.dustin.n_sink) if setup.dustin is not None else (setup.draft_budget, 4)


def _streamingllm(setup: MethodSetup, drafter: Drafter) -> Selector:
    cache = setup.target_cache
    return StreamingLLMSelector(*_budget(setup), cache.batch_slots, cache.seqlens.device)


def _snapkv(setup: MethodSetup, drafter: Drafter) -> Selector:
    return SnapKVSelector(*_budget(setup), setup.target, setup.target_cache, setup.backend)


def _quest(setup: MethodSetup, drafter: Drafter) -> Selector:
    return QuestSelector(*_budget(setup), setup.target_cache, setup.target.config, setup.target.embed.weight.dtype)


_FULL_DRAFT = _model_drafter(lambda s: FullCacheView())
HISTORY_DECAY = 0.9  # dustin-h-accum: the running sum's decay per round (a memory of about 10 rounds, 25 tokens)
PERIODIC_EVERY = 4  # dustin-h-periodic: one round in 4 verifies in full
IN_PASS_LOOKAHEAD_SHARE = 0.25  # dustin-ip-la: the share of the free slots the draft's lookahead takes
METHODS: dict[str, Method] = {
    "vanilla": Method(_no_draft, _full, "plain decoding, one token per step", needs_draft=False),
    "classic": Method(_FULL_DRAFT, _full, "Classic SD: full-cache draft, full verification"),
    "magicdec": Method(_model_drafter(lambda s: StreamingWindowView(s.draft_budget)), _full,
                       "MagicDec: StreamingLLM-window draft (--draft-budget), full verification"),
    "dustin-h": Method(_FULL_DRAFT, _dustin("h"), "Dustin-H: sparse verification, Eq. 6 hybrid set",
                       needs_dustin=True, sparse=True),
    "dustin-t": Method(_FULL_DRAFT, _dustin("t"), "Dustin-T: sparse verification by the target's history",
                       needs_dustin=True, sparse=True),
    "dustin-d": Method(_FULL_DRAFT, _dustin("d"), "Dustin-D: sparse verification by the draft's lookahead",
                       needs_dustin=True, sparse=True),
    "dustin-h-sparse-draft": Method(_model_drafter(_verification_set), _dustin("h"),
                                    "Dustin-H whose draft also reads only the verification set", needs_dustin=True,
                                    sparse=True),
    "streamingllm": Method(_FULL_DRAFT, _streamingllm, "sparse verification by StreamingLLM's set (baseline)",
                           sparse=True),
    "snapkv": Method(_FULL_DRAFT, _snapkv, "sparse verification by SnapKV's prompt-time set (baseline)",
                     sparse=True),
    "quest": Method(_FULL_DRAFT, _quest, "sparse verification by Quest's page bounds (baseline)", sparse=True),
    "dustin-h-adaptive": Method(_FULL_DRAFT, _dustin("h", adaptive=True),
                                "Dustin-H with m from the draft's confidence (evaluation only)", needs_dustin=True,
                                sparse=True, offered=False),
    # Closing Dustin's gap to full verification (issue 24; evaluation only, benchmarks/eval_quality.py): the oracle
    # ceilings, and three changes to Dustin-H measured against it at equal k.
    "oracle": Method(_FULL_DRAFT, _oracle("all"), "the top k by the target's true attention of the round's queries "
                     "(an extra full pass; evaluation only)", sparse=True, offered=False, eager_only=True),
    "oracle-layer": Method(_FULL_DRAFT, _oracle("layer"), "the oracle with a set per layer (evaluation only)",
                           sparse=True, offered=False, eager_only=True),
    "oracle-kv-head": Method(_FULL_DRAFT, _oracle("kv-head"), "the oracle with a set per KV head (evaluation only)",
                             sparse=True, offered=False, eager_only=True),
    "dustin-h-accum": Method(_FULL_DRAFT, _dustin("h", history_decay=HISTORY_DECAY),
                             f"Dustin-H whose S_target sums the committed tokens' attention over rounds (decay "
                             f"{HISTORY_DECAY}; evaluation only)", needs_dustin=True, sparse=True, offered=False),
    "dustin-h-kv-head": Method(_FULL_DRAFT, _dustin("h", per_kv_head=True),
                               "Dustin-H with a set per KV head (evaluation only)", needs_dustin=True, sparse=True,
                               offered=False),
    "dustin-h-periodic": Method(_FULL_DRAFT, _periodic(PERIODIC_EVERY),
                                f"Dustin-H verifying every {PERIODIC_EVERY}th round in full (evaluation only)",
                                needs_dustin=True, sparse=True, offered=False, eager_only=True),
    # In-pass selection (issue 35): the verification pass picks its set from its own queries at the selection layers.
    "dustin-ip": Method(_FULL_DRAFT, _in_pass(), "in-pass selection: the verification queries pick the set at the "
                        "searched selection layers", needs_dustin=True, sparse=True),
    "dustin-ip-pages": Method(_FULL_DRAFT, _in_pass(pages=True), "in-pass selection by page bounds (Quest style) of "
                              "the verification queries", needs_dustin=True, sparse=True),
    "dustin-ip-sparse-draft": Method(_model_drafter(_verification_set), _in_pass(),
                                     "in-pass selection whose draft also reads only the set", needs_dustin=True,
                                     sparse=True),
    "dustin-ip-la": Method(_FULL_DRAFT, _in_pass(lookahead_share=IN_PASS_LOOKAHEAD_SHARE),
                           f"in-pass selection beside the draft's lookahead (m = {IN_PASS_LOOKAHEAD_SHARE:g} of the "
                           "free slots; evaluation only)", needs_dustin=True, sparse=True, offered=False),
    "dustin-ip-dense": Method(_FULL_DRAFT, _in_pass(dense=True), "in-pass selection with the layers before the "
                              "selection layer verified in full (evaluation only)", needs_dustin=True, sparse=True,
                              offered=False),
    "longspark": Method(_longspark, _full, "LongSpark: fixed-cost block-parallel draft (--longspark), full "
                        "verification", needs_draft=False, needs_longspark=True),
    "dustin-h-longspark": Method(_longspark, _dustin_longspark("h"), "LongSpark draft, Dustin-H sparse verification "
                                 "(lookahead scored on the target's keys; evaluation only: it did not beat Dustin-T)",
                                 needs_draft=False, needs_longspark=True, needs_dustin=True, sparse=True,
                                 offered=False),
    "dustin-t-longspark": Method(_longspark, _dustin_longspark("t"), "LongSpark draft, Dustin-T sparse verification "
                                 "(the target's history picks the set)", needs_draft=False, needs_longspark=True,
                                 needs_dustin=True, sparse=True),
    "dustin-ip-longspark": Method(_longspark, _in_pass(), "LongSpark draft, in-pass selection", needs_draft=False,
                                  needs_longspark=True, needs_dustin=True, sparse=True),
}
OFFERED_METHODS = tuple(name for name, method in METHODS.items() if method.offered)


def build_decoder(method: str, setup: MethodSetup) -> Decoder:
    """The Decoder of a registered method, checked before anything is allocated beyond the caches given."""
    if method not in METHODS:
        raise ConfigError(f"method {method!r} is unknown; choose one of {', '.join(OFFERED_METHODS)}")
    spec = METHODS[method]
    if spec.needs_draft and (setup.draft is None or setup.draft_cache is None):
        raise ConfigError(f"method {method} needs a draft model; pass --draft DIR|FILE.gguf|preset:NAME")
    if spec.needs_longspark and setup.longspark is None:
        raise ConfigError(f"method {method} needs a LongSpark drafter; pass --longspark DIR (default with the default "
                          "model: the packaged one)")
    if spec.needs_longspark and setup.longspark.target is not setup.target:
        raise ConfigError(f"method {method}: the LongSpark drafter is attached to another target model than this one")
    if spec.eager_only and setup.use_cuda_graph and setup.target_cache.seqlens.device.type == "cuda":
        raise ConfigError(f"{method} decides on the host round by round and cannot run in CUDA graphs; build it with "
                          "use_cuda_graph=False (it is evaluation only)")
    if spec.needs_dustin and setup.dustin is None:
        raise ConfigError(f"{method} needs a Dustin configuration (SRH layers/heads, budget, m); pass "
                          "--dustin-config FILE, written by `trtllm-dustin search` for this target/draft pair")
    tcache = setup.target_cache
    if spec.needs_draft:
        dcache = setup.draft_cache
        if (tcache.batch_slots, tcache.max_seq_len) != (dcache.batch_slots, dcache.max_seq_len):
            raise ValueError(f"target and draft caches must have the same batch slots and max_seq_len; got "
                             f"{tcache.batch_slots} x {tcache.max_seq_len} and {dcache.batch_slots} x "
                             f"{dcache.max_seq_len}")
    models = (setup.target, setup.draft) if spec.needs_draft else (setup.target,)
    for model in models:  # read once here; the graphs record what they were captured with
        model.kernels = setup.kernels
    device = tcache.seqlens.device
    graphs = PhaseGraphs(setup.use_cuda_graph and device.type == "cuda", setup.kernels)
    drafter = spec.drafter(setup, graphs)
    selector = spec.selector(setup, drafter)
    if (selector.budget is not None) != spec.sparse:
        raise RuntimeError(f"method {method}: its registry entry says sparse={spec.sparse}, its selector disagrees")
    shared_vocab = setup.draft.config.vocab_size if spec.needs_draft else setup.target.config.vocab_size
    return Decoder(method, setup.target, tcache, drafter, selector, setup.backend, graphs, setup.kernels,
                   shared_vocab)
