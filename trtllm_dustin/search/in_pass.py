"""The selection-layer search: which target layers choose the verification set inside the pass (in-pass selection).

Algorithm 1 (algorithm.py) picks the SRH layers of Dustin's estimator by ARR. The in-pass selector
(runtime/selectors/in_pass.py) has choices left that the data must make: at which layer(s), scored on which heads
(every head, or the layer's semantic retrieval heads from `trtllm-dustin srh`), the verification queries choose the
set, and how far a chosen position reaches (the score window). This extends the search with phases over
teacher-forced traces of the train split:

  phase A  the candidate (layer l, heads) with the best objective: the set chosen at l from its Γ + 1 queries (Eq. 5
           over those heads), read by l and the following layers; the layers before l read the previous round's
           choice (`lag` steps back)
  phase B  greedily add a re-selection candidate at a later layer while it raises the objective by `min_gain`, at
           most `max_layers` selection layers in all (each costs one more scoring pass over K); with `earlier`, a
           layer below the first selection layer is a candidate too: it chooses a set for the layers up to the next
           selection layer, which would otherwise read the previous round's
  phase C  greedily add a pooled candidate below the first selection layer, whose scores are summed into that
           layer's before it chooses, while it raises the objective by `min_gain`, at most `max_pool` (each costs
           one more scoring pass over K; the oracle's set sums every layer's attention)
  phase D  the score window (DustinConfig.score_window): each of `windows` (odd width, max or mean over neighbouring
           positions before the top-k) on the layers of A-C; the best is kept if it raises the objective by
           `min_gain` over no window

The objective is the sum of two means over the search budgets, each in [0, 1]:
  text ARR       over windows of the corpora: the mean over the target's layers and steps of each layer's windowed
                 ARR (Eq. 2) of the set it reads, against that layer's own attention of the verification queries (all
                 heads, renormalised over [0, L)); a dense layer counts 1
  needle recall  over needle-in-a-haystack prompts of the train split's essays, teacher-forced through the needle
                 sentence: the share of the needle's tokens in the set each layer reads while the answer is verified
                 (what sparse verification loses on retrieval, which ARR over ordinary text barely sees)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import SCORE_WINDOW_OPS
from trtllm_dustin.plugins.selection import window_scores
from trtllm_dustin.search.arr import arr
from trtllm_dustin.search.attention_trace import AttentionTrace

__all__ = ["NO_WINDOW", "Candidate", "InPassObjective", "InPassOutcome", "InPassSettings", "SearchTraces", "Window",
           "search_selection_layers"]

Window = tuple[int, str]  # (odd width, "max" | "mean"): DustinConfig's score_window and score_window_op
NO_WINDOW: Window = (1, "max")


@dataclass(frozen=True)
class InPassSettings:
    budgets: tuple[int, ...] = (256, 512, 1024)  # k of the ARR mean (the deployment k and around it)
    lag: int = 2  # steps between a round's choice and the next round's pre-pass (about the mean accepted length)
    max_layers: int = 2  # selection layers in all (the first chooses, the others re-select)
    min_gain: float = 0.002  # phases B and C add a layer only if the objective rises by this much
    max_pool: int = 3  # phase C: pooled layers in all
    earlier: bool = False  # phase B also tries layers below the first selection layer (each chooses for the layers
    #                        up to the next selection layer, which chooses again)
    windows: tuple[Window, ...] = ()  # phase D's score windows (none: phase D is skipped)
    n_sink: int = 4
    n_recent: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(int(b) for b in self.budgets))
        if not self.budgets or min(self.budgets) <= self.n_sink + self.n_recent:
            raise ConfigError(f"in-pass search budgets {self.budgets} must be non-empty and exceed sinks + recent "
                              f"window = {self.n_sink + self.n_recent}")
        if self.lag < 1 or self.max_layers < 1 or self.max_pool < 0:
            raise ConfigError(f"lag={self.lag} and max_layers={self.max_layers} must be >= 1, max_pool="
                              f"{self.max_pool} >= 0")
        object.__setattr__(self, "windows", tuple((int(w), str(op)) for w, op in self.windows))
        for width, op in self.windows:
            if width < 3 or width % 2 == 0 or op not in SCORE_WINDOW_OPS:
                raise ConfigError(f"score window {width}{op}: the width must be odd and >= 3 and the op one of "
                                  f"{SCORE_WINDOW_OPS} (say 5max)")


Candidate = tuple[int, str]  # (layer, head set): "all" its heads, or "srh" its semantic retrieval heads


@dataclass(frozen=True)
class InPassOutcome:
    layers: tuple[Candidate, ...]  # the selection layers (ascending) and the heads each scores on
    value: float  # their objective
    phase_a: dict[Candidate, float]  # candidate -> objective alone
    phase_b: list[dict[Candidate, float]]  # per round: candidate re-selection -> objective with it added
    by_budget: dict[int, dict[str, float]]  # the outcome's text ARR and needle recall at each search budget
    pool: tuple[Candidate, ...] = ()  # the pooled layers (ascending), below the first selection layer
    phase_c: list[dict[Candidate, float]] = ()  # per round: candidate pooled layer -> objective with it added
    window: Window = NO_WINDOW  # phase D's pick
    phase_d: dict[Window, float] = ()  # score window -> objective with it (NO_WINDOW: the outcome of A-C)

    def to_dict(self) -> dict:
        return {"layers": [{"layer": layer, "heads": kind} for layer, kind in self.layers], "value": self.value,
                "phase_a": [{"layer": c[0], "heads": c[1], "objective": round(v, 6)} for c, v in self.phase_a.items()],
                "phase_b": [[{"layer": c[0], "heads": c[1], "objective": round(v, 6)} for c, v in r.items()]
                            for r in self.phase_b],
                "pool": [{"layer": layer, "heads": kind} for layer, kind in self.pool],
                "phase_c": [[{"layer": c[0], "heads": c[1], "objective": round(v, 6)} for c, v in r.items()]
                            for r in self.phase_c],
                "window": {"width": self.window[0], "op": self.window[1]},
                "phase_d": [{"width": w[0], "op": w[1], "objective": round(v, 6)}
                            for w, v in dict(self.phase_d).items()],
                "by_budget": self.by_budget}


@dataclass(frozen=True)
class SearchTraces:
    """One part of the objective: a trace measured with every head of every layer (the truth, and the "all" scores)
    and, optionally, one measured with each layer's SRH heads (the "srh" scores)."""

    every_head: AttentionTrace
    srh: AttentionTrace | None = None
    needle_spans: torch.Tensor | None = None  # int64 [documents, 2]: [start, end) of each window's needle (needles)

    def maps(self, kind: str) -> torch.Tensor:
        trace = self.every_head if kind == "all" else self.srh
        if trace is None:
            raise ConfigError("an srh candidate needs the trace measured with the SRH heads (--srh)")
        return trace.target_maps


class InPassObjective:
    """The search's objective (module doc) over a text part and an optional needle part."""

    def __init__(self, text: SearchTraces, settings: InPassSettings, needles: SearchTraces | None = None) -> None:
        self.text, self.needles, self.settings = text, needles, settings
        layers = tuple(lh.layer for lh in text.every_head.target_srh)
        if layers != tuple(range(len(layers))):
            raise ConfigError("the in-pass search needs a trace of every target layer (0 .. L-1) with all heads")
        self.layers = layers
        kinds = ("all", "srh") if text.srh is not None and (needles is None or needles.srh is not None) else ("all",)
        self.candidates: tuple[Candidate, ...] = tuple((layer, kind) for layer in layers for kind in kinds)
        for part in (text, needles):
            if part is not None and part.every_head.settings.steps <= settings.lag:
                raise ConfigError(f"a trace has {part.every_head.settings.steps} steps per window; the pre-pass lag "
                                  f"{settings.lag} needs more")
        self._sets: dict[tuple, torch.Tensor] = {}

    # ---- sets --------------------------------------------------------------------------------------------------------
    @staticmethod
    def _scores(part: SearchTraces, candidate: Candidate) -> torch.Tensor:
        """[R, S]: Eq. 5 of the Γ + 1 verification queries at L .. L + Γ over the candidate's heads, j < L."""
        trace = part.every_head
        s = trace.settings
        maps = part.maps(candidate[1])[candidate[0]]  # [documents, captured, S]: head-summed probabilities
        total = sum(maps[:, s.max_delta + t: s.max_delta + t + s.steps] for t in range(s.gamma + 1))
        scores = total.reshape(-1, maps.shape[-1])
        return scores * (torch.arange(scores.shape[1])[None, :] < trace.seqlens.long()[:, None])

    def chosen(self, part: SearchTraces, candidate: Candidate | tuple[Candidate, ...], budget: int,
               window: Window = NO_WINDOW) -> torch.Tensor:
        """int64 [R, k]: the set the candidate chooses at each step (sinks + top + recent, all of [0, L) if L <= k);
        a tuple of candidates chooses from the sum of their scores (pooling), through the score window."""
        pooled = candidate if isinstance(candidate[0], tuple) else (candidate,)
        key = (id(part), pooled, budget, window)
        if key not in self._sets:
            cfg = self.settings
            scores = window_scores(sum(self._scores(part, c) for c in pooled), *window)
            lengths = part.every_head.seqlens.long()[:, None]
            positions = torch.arange(scores.shape[1])[None, :]
            candidate_mask = (positions >= cfg.n_sink) & (positions < lengths - cfg.n_recent)
            free = budget - cfg.n_sink - cfg.n_recent
            top = torch.topk(scores.masked_fill(~candidate_mask, float("-inf")), free, dim=1).indices
            chosen = torch.cat([positions[:, : cfg.n_sink].expand(len(lengths), -1), top,
                                lengths - cfg.n_recent + torch.arange(cfg.n_recent)[None, :]], dim=1)
            every = torch.where(positions[:, :budget] < lengths, positions[:, :budget], -1)
            self._sets[key] = torch.where(lengths > budget, chosen, every)
        return self._sets[key]

    def _previous(self, part: SearchTraces, sets: torch.Tensor) -> torch.Tensor:
        """The set `lag` steps back in the same window (the previous round's choice), with the recent window moved to
        the current step's L; a window's first steps keep their own set."""
        s, cfg = part.every_head.settings, self.settings
        rows = sets.view(s.documents, s.steps, -1)
        shifted = torch.cat([rows[:, : cfg.lag], rows[:, : -cfg.lag]], dim=1).reshape(sets.shape).clone()
        lengths = part.every_head.seqlens.long()[:, None]
        budget = sets.shape[1]
        shifted[:, budget - cfg.n_recent:] = lengths - cfg.n_recent + torch.arange(cfg.n_recent)[None, :]
        every = torch.where(torch.arange(budget)[None, :] < lengths, torch.arange(budget)[None, :], -1)
        return torch.where(lengths > budget, shifted, every)

    def _reads(self, part: SearchTraces, selection: Sequence[Candidate], budget: int,
               pool: Sequence[Candidate] = (), window: Window = NO_WINDOW) -> list[torch.Tensor]:
        """The set each target layer reads under the configuration (selection ascending by layer; the first
        selection layer chooses from its scores summed with the pooled candidates')."""
        selection = sorted(selection)
        choosers = [tuple(sorted(pool)) + (selection[0],), *((c,) for c in selection[1:])]
        previous = self._previous(part, self.chosen(part, choosers[-1], budget, window))
        out = []
        for layer in self.layers:
            readers = [c for c in choosers if c[-1][0] <= layer]
            out.append(self.chosen(part, readers[-1], budget, window) if readers else previous)
        return out

    # ---- the objective -----------------------------------------------------------------------------------------------
    def per_layer(self, selection: Sequence[Candidate], budget: int, dense: int = 0,
                  pool: Sequence[Candidate] = (), window: Window = NO_WINDOW) -> list[float]:
        """Each target layer's mean text ARR under the configuration (`dense` first layers in full)."""
        reads = self._reads(self.text, selection, budget, pool, window)
        return [1.0 if layer < dense else float(arr(self.text.every_head.truth_by_layer[layer], sets).mean())
                for layer, sets in zip(self.layers, reads, strict=True)]

    def text_arr(self, selection: Sequence[Candidate], budget: int, dense: int = 0,
                 pool: Sequence[Candidate] = (), window: Window = NO_WINDOW) -> float:
        values = self.per_layer(selection, budget, dense, pool, window)
        return sum(values) / len(values)

    def needle_recall(self, selection: Sequence[Candidate], budget: int, pool: Sequence[Candidate] = (),
                      window: Window = NO_WINDOW) -> float:
        """The mean over layers and answer steps of the share of the needle's tokens in the set each layer reads."""
        if self.needles is None:
            return 0.0
        part = self.needles
        s = part.every_head.settings
        spans = part.needle_spans.repeat_interleave(s.steps, dim=0)  # [R, 2]
        shares = []
        for sets in self._reads(part, selection, budget, pool, window):
            inside = (sets[:, :, None] >= spans[:, None, :1]) & (sets[:, :, None] < spans[:, None, 1:])
            shares.append(inside.sum((1, 2)).float() / (spans[:, 1] - spans[:, 0]).float())
        return float(torch.stack(shares).mean())

    def mean(self, selection: Sequence[Candidate], pool: Sequence[Candidate] = (),
             window: Window = NO_WINDOW) -> float:
        budgets = self.settings.budgets
        return sum(self.text_arr(selection, b, pool=pool, window=window)
                   + self.needle_recall(selection, b, pool, window) for b in budgets) / len(budgets)


def search_selection_layers(objective: InPassObjective, progress: bool = True) -> InPassOutcome:
    """Phases A to D (module doc). Ties go to the lower layer, then to every head, then to no window."""
    settings = objective.settings

    def order(c: Candidate, value: float) -> tuple:
        return value, -c[0], c[1] == "all"

    phase_a = {c: objective.mean([c]) for c in tqdm(objective.candidates, desc="phase A: selection layer",
                                                    disable=not progress)}
    chosen = [max(phase_a, key=lambda c: order(c, phase_a[c]))]
    best = phase_a[chosen[0]]
    phase_b: list[dict[Candidate, float]] = []
    while len(chosen) < settings.max_layers:
        taken = {c[0] for c in chosen}
        tried = [c for c in objective.candidates
                 if c[0] > chosen[-1][0] or (settings.earlier and c[0] not in taken)]
        if not tried:
            break
        scores = {c: objective.mean([*chosen, c]) for c in tqdm(
            tried, desc=f"phase B: re-selection layer {len(chosen)}", disable=not progress)}
        phase_b.append(scores)
        pick = max(scores, key=lambda c: order(c, scores[c]))
        if scores[pick] < best + settings.min_gain:
            break
        chosen = sorted([*chosen, pick])
        best = scores[pick]
    pool: list[Candidate] = []
    phase_c: list[dict[Candidate, float]] = []
    while len(pool) < settings.max_pool:
        below = [c for c in objective.candidates if c[0] < chosen[0][0] and c[0] not in {p[0] for p in pool}]
        if not below:
            break
        scores = {c: objective.mean(chosen, [*pool, c]) for c in tqdm(
            below, desc=f"phase C: pooled layer {len(pool) + 1}", disable=not progress)}
        phase_c.append(scores)
        pick = max(scores, key=lambda c: order(c, scores[c]))
        if scores[pick] < best + settings.min_gain:
            break
        pool.append(pick)
        best = scores[pick]
    phase_d: dict[Window, float] = {}
    window = NO_WINDOW
    if settings.windows:
        phase_d = {NO_WINDOW: best, **{w: objective.mean(chosen, pool, w) for w in tqdm(
            settings.windows, desc="phase D: score window", disable=not progress)}}
        pick = max(settings.windows, key=lambda w: phase_d[w])
        if phase_d[pick] >= best + settings.min_gain:
            window, best = pick, phase_d[pick]
    by_budget = {b: {"text_arr": objective.text_arr(chosen, b, pool=pool, window=window),
                     "needle_recall": objective.needle_recall(chosen, b, pool, window)} for b in settings.budgets}
    return InPassOutcome(tuple(chosen), best, phase_a, phase_b, by_budget, tuple(sorted(pool)), phase_c, window,
                         phase_d)
