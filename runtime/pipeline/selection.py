"""Which methods run pipeline-parallel, and how a sparse method's verification set is computed across stages.

The set is layer-invariant by design (one I_verify per slot for every layer and head), so it is computed once per
round, on the first stage, and travels with the hidden states. In-pass selection (selectors/in_pass.py) chooses it
inside the pass instead: the stage that owns a selection layer rewrites the set it received before its layer attends
and sends the new one on; the last stage sends the final set back to the first, whose pre-pass and sparse draft start
from it next round, and the owner of the first selection layer seeds round 1's set after the prefill.

Dustin's estimate (selectors/dustin.py, Eq. 5-6) has two halves that live on different stages:

    S_draft   the draft's lookahead against the draft's keys: the first stage (it holds the draft)
    S_target  the target's history query against an SRH layer's keys: the stage that owns that layer

Each owning stage scores its SRH layers (one DustinSelector per layer, over the stage's own cache, with that layer
renumbered to the stage's local index and m = 0 so that it never reads a lookahead) and sends each layer's score to
the first stage, which sums them in the config's layer order, as `DustinSelector.estimate` accumulates them, so the
sum is the single-process one bit for bit. The first stage's own DustinSelector (the registry's, built from the
config without target layers) scores S_draft and runs `select` on S_draft and the summed S_target. Over a LongSpark
draft S_draft scores the LongSpark blocks' lookahead against the target's keys of the layers they read, which the
first stage holds or keeps a copy of (runtime/pipeline/longspark.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView
from trtllm_dustin.runtime.methods import longspark_lookahead
from trtllm_dustin.runtime.pipeline.stage import PipelineStage
from trtllm_dustin.runtime.selectors import DustinSelector
from trtllm_dustin.runtime.state import Observation

__all__ = ["PIPELINE_METHODS", "PipelineMethod", "TargetHistory", "pipeline_method", "sum_in_order"]


@dataclass(frozen=True)
class PipelineMethod:
    """How a registry method (runtime/methods.py) splits over the stages."""

    dustin_variant: str | None = None  # Dustin's S_target is scored on the owning stages ("h", "t", "d"); None: the
    # selector (full verification, or a set from the lengths alone) runs whole on the first stage
    in_pass: bool = False  # in-pass selection: the stage that owns a selection layer chooses and sends the set on
    # A LongSpark draft (on the first stage): the stages that hold the target layers it reads send their K/V rows and
    # hidden states to the first stage (runtime/pipeline/decoder.py), and its lookahead is the LongSpark blocks'
    longspark: bool = False

    def first_stage_config(self, dustin: DustinConfig, longspark_layers: Sequence[int] = ()) -> DustinConfig:
        """The Dustin config the first stage's selector is built from: its S_target half scores nothing there.
        longspark_layers: the target layers a LongSpark draft reads (its S_draft scores their blocks)."""
        if self.longspark:
            return replace(longspark_lookahead(dustin, longspark_layers, self.dustin_variant), target_layers=())
        if not dustin.draft_layers:
            raise ConfigError("under --pp-size > 1 a Dustin config needs at least one draft SRH layer (the first "
                              "stage scores the draft's lookahead); search one with draft layers or run --pp-size 1")
        return replace(dustin, target_layers=())

    def reads_target(self, dustin: DustinConfig) -> bool:
        """Whether the variant's set takes any position by S_target (Dustin-D never does)."""
        config = dustin.variant(self.dustin_variant)
        return config.m < config.budget - config.n_sink - config.n_recent


_DUSTIN = {"dustin-h": "h", "dustin-t": "t", "dustin-d": "d", "dustin-h-sparse-draft": "h"}
_DUSTIN_LONGSPARK = {"dustin-h-longspark": "h", "dustin-t-longspark": "t"}
PIPELINE_METHODS: dict[str, PipelineMethod] = {
    "vanilla": PipelineMethod(), "classic": PipelineMethod(), "magicdec": PipelineMethod(),
    "streamingllm": PipelineMethod(),  # its set follows the lengths alone: every stage has them, the first picks
    **{name: PipelineMethod(variant) for name, variant in _DUSTIN.items()},
    "dustin-ip": PipelineMethod(in_pass=True), "dustin-ip-sparse-draft": PipelineMethod(in_pass=True),
    "longspark": PipelineMethod(longspark=True),
    **{name: PipelineMethod(variant, longspark=True) for name, variant in _DUSTIN_LONGSPARK.items()},
    "dustin-ip-longspark": PipelineMethod(in_pass=True, longspark=True),
}
_WHY_NOT = {
    "snapkv": "its prompt-time set reads the target's attention over the whole prompt on one process",
    "quest": "its page bounds read the target's keys of every layer on one process",
    "dustin-h-adaptive": "it is an evaluation-only method",
    "dustin-ip-pages": "its page key ranges live with the selection layer's keys, which the first stage may not hold",
    "dustin-ip-la": "it is an evaluation-only method",
    "dustin-ip-dense": "it is an evaluation-only method",
    **dict.fromkeys(("ring", "dustin-ip-ring"), "the ring drafter is fed the hidden states of target layers that "
                    "other stages hold, each round"),
}


def pipeline_method(name: str) -> PipelineMethod:
    """The method's split, or a ConfigError naming it and the fix."""
    if name not in PIPELINE_METHODS:
        why = _WHY_NOT.get(name, "it has no pipeline-parallel split")
        raise ConfigError(f"method {name} does not run pipeline-parallel ({why}); run it with --pp-size 1 (one "
                          f"process), or choose one of {', '.join(PIPELINE_METHODS)}")
    return PIPELINE_METHODS[name]


class TargetHistory:
    """S_target of the Dustin SRH target layers one stage owns, for one micro-batch: each layer's history query
    (the last committed token's) scored against that layer's keys in the stage's cache."""

    def __init__(self, dustin: DustinConfig, stage: PipelineStage, cache: KVCache, pdl: bool = False) -> None:
        self.layers = tuple(lh.layer for lh in dustin.target_layers if stage.owns(lh.layer))  # global, config order
        self._local = {lh.layer: lh.layer - stage.start for lh in dustin.target_layers if stage.owns(lh.layer)}
        dtype = next(stage.parameters()).dtype
        self._parts = [DustinSelector(replace(dustin, target_layers=(LayerHeads(self._local[lh.layer], lh.heads),),
                                              draft_layers=(), m=0), cache, stage.config, dtype, Lookahead({}, {}),
                                      pdl=pdl)
                       for lh in dustin.target_layers if stage.owns(lh.layer)]

    def on_prefill(self, view: PrefillView) -> None:
        """view.queries: global layer -> the last prompt token's query [n, H_q, D]."""
        for layer, part in zip(self.layers, self._parts, strict=True):
            part.on_prefill(replace(view, queries={self._local[layer]: view.queries[layer]}))

    def observe(self, seen: Observation) -> None:
        """seen.verify_queries: global layer -> the verified tokens' queries [B, Γ + 1, H_q, D]."""
        for layer, part in zip(self.layers, self._parts, strict=True):
            part.observe(replace(seen, verify_queries={self._local[layer]: seen.verify_queries[layer]}))

    def scores(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Each owned layer's S_target, fp32 [B, S_max] (the parts' own buffers), in config order."""
        return [part.estimate(lengths)[1] for part in self._parts]


def sum_in_order(layers: Sequence[int], scores: dict[int, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """S_target = the layers' scores added in config order into `out` (the first copied), as DustinSelector
    accumulates them."""
    for i, layer in enumerate(layers):
        if i == 0:
            out.copy_(scores[layer])
        else:
            out.add_(scores[layer])
    return out
