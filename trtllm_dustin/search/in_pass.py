"""The selection-layer search: which target layers choose the verification set inside the pass (in-pass selection).

Algorithm 1 (algorithm.py) picks the SRH layers of Dustin's estimator by ARR. The in-pass selector
(runtime/selectors/in_pass.py) has one choice left that the data must make: at which layer(s) the verification
queries choose the set. This extends the search with two phases over the same teacher-forced traces (train split),
collected with every target layer and head:

  phase A  l_1 = argmax_l ARR(l): the set chosen at l from its Γ + 1 queries (Eq. 5 over all its heads), read by
           l and the following layers; the layers before l read the previous round's choice (`lag` steps back)
  phase B  greedily add a re-selection layer l' > l_1 while it raises ARR by at least `min_gain`, at most
           `max_layers` selection layers in all (each costs one more scoring pass over K)

ARR(config) is the mean over the target's layers and the trace's steps of each layer's windowed ARR (Eq. 2) of the
set that layer reads, against that layer's own attention of the verification queries (all heads, renormalised over
[0, L)); a dense layer (full cache) counts 1. The mean is over the search budgets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from trtllm_dustin.config import ConfigError
from trtllm_dustin.search.arr import arr
from trtllm_dustin.search.attention_trace import AttentionTrace

__all__ = ["InPassObjective", "InPassOutcome", "InPassSettings", "search_selection_layers"]


@dataclass(frozen=True)
class InPassSettings:
    budgets: tuple[int, ...] = (256, 512, 1024)  # k of the ARR mean (the deployment k and around it)
    lag: int = 2  # steps between a round's choice and the next round's pre-pass (about the mean accepted length)
    max_layers: int = 2  # selection layers in all (the first chooses, the others re-select)
    min_gain: float = 0.002  # phase B adds a layer only if the mean ARR rises by this much
    n_sink: int = 4
    n_recent: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "budgets", tuple(int(b) for b in self.budgets))
        if not self.budgets or min(self.budgets) <= self.n_sink + self.n_recent:
            raise ConfigError(f"in-pass search budgets {self.budgets} must be non-empty and exceed sinks + recent "
                              f"window = {self.n_sink + self.n_recent}")
        if self.lag < 1 or self.max_layers < 1:
            raise ConfigError(f"lag={self.lag} and max_layers={self.max_layers} must be >= 1")


@dataclass(frozen=True)
class InPassOutcome:
    layers: tuple[int, ...]  # the selection layers, ascending
    arr: float  # their mean ARR
    phase_a: dict[int, float]  # candidate layer -> mean ARR alone
    phase_b: list[dict[int, float]]  # per round: candidate re-selection layer -> mean ARR with it added
    by_budget: dict[int, float]  # the outcome's ARR at each search budget

    def to_dict(self) -> dict:
        data = asdict(self)
        data["phase_a"] = [{"layer": k, "arr": round(v, 6)} for k, v in self.phase_a.items()]
        data["phase_b"] = [[{"layer": k, "arr": round(v, 6)} for k, v in r.items()] for r in self.phase_b]
        return data


class InPassObjective:
    """Mean per-layer ARR of in-pass configurations over a trace that measured every target layer with all heads."""

    def __init__(self, trace: AttentionTrace, settings: InPassSettings) -> None:
        self.trace, self.settings = trace, settings
        self.layers = tuple(lh.layer for lh in trace.target_srh)
        if self.layers != tuple(range(len(self.layers))):
            raise ConfigError("the in-pass search needs a trace of every target layer (0 .. L-1) with all heads")
        s = trace.settings
        if s.steps <= settings.lag:
            raise ConfigError(f"the trace has {s.steps} steps per window; the pre-pass lag {settings.lag} needs more")
        self._sets: dict[tuple[int, int], torch.Tensor] = {}

    def _scores(self, layer: int) -> torch.Tensor:
        """[R, S]: Eq. 5 of the Γ + 1 verification queries at L .. L + Γ over all heads, j < L."""
        s = self.trace.settings
        maps = self.trace.target_maps[layer]  # [documents, captured, S]: head-summed probabilities per query
        total = sum(maps[:, s.max_delta + t: s.max_delta + t + s.steps] for t in range(s.gamma + 1))
        scores = total.reshape(-1, maps.shape[-1])
        positions = torch.arange(scores.shape[1])
        return scores * (positions[None, :] < self.trace.seqlens.long()[:, None])

    def chosen(self, layer: int, budget: int) -> torch.Tensor:
        """int64 [R, k]: the set layer `layer` chooses at each step (sinks + top + recent, all of [0, L) if L <= k)."""
        key = (layer, budget)
        if key not in self._sets:
            cfg = self.settings
            scores, lengths = self._scores(layer), self.trace.seqlens.long()[:, None]
            positions = torch.arange(scores.shape[1])[None, :]
            candidate = (positions >= cfg.n_sink) & (positions < lengths - cfg.n_recent)
            free = budget - cfg.n_sink - cfg.n_recent
            top = torch.topk(scores.masked_fill(~candidate, float("-inf")), free, dim=1).indices
            chosen = torch.cat([positions[:, : cfg.n_sink].expand(len(lengths), -1), top,
                                lengths - cfg.n_recent + torch.arange(cfg.n_recent)[None, :]], dim=1)
            every = torch.where(positions[:, :budget] < lengths, positions[:, :budget], -1)
            self._sets[key] = torch.where(lengths > budget, chosen, every)
        return self._sets[key]

    def _previous(self, sets: torch.Tensor) -> torch.Tensor:
        """The set `lag` steps back in the same window (the previous round's choice), with the recent window moved to
        the current step's L; a window's first steps keep their own set."""
        s, cfg = self.trace.settings, self.settings
        rows = sets.view(s.documents, s.steps, -1)
        shifted = torch.cat([rows[:, : cfg.lag], rows[:, : -cfg.lag]], dim=1).reshape(sets.shape).clone()
        lengths = self.trace.seqlens.long()[:, None]
        budget = sets.shape[1]
        shifted[:, budget - cfg.n_recent:] = lengths - cfg.n_recent + torch.arange(cfg.n_recent)[None, :]
        every = torch.where(torch.arange(budget)[None, :] < lengths, torch.arange(budget)[None, :], -1)
        return torch.where(lengths > budget, shifted, every)

    def per_layer(self, selection: Sequence[int], budget: int, dense: int = 0) -> list[float]:
        """Each target layer's mean ARR under the configuration (selection layers ascending, `dense` full layers)."""
        selection = sorted(selection)
        previous = self._previous(self.chosen(selection[-1], budget))
        out = []
        for layer in self.layers:
            if layer < dense:
                out.append(1.0)
                continue
            readers = [sel for sel in selection if sel <= layer]
            sets = self.chosen(readers[-1], budget) if readers else previous
            out.append(float(arr(self.trace.truth_by_layer[layer], sets).mean()))
        return out

    def score(self, selection: Sequence[int], budget: int, dense: int = 0) -> float:
        values = self.per_layer(selection, budget, dense)
        return sum(values) / len(values)

    def mean(self, selection: Sequence[int], dense: int = 0) -> float:
        return sum(self.score(selection, b, dense) for b in self.settings.budgets) / len(self.settings.budgets)


def search_selection_layers(objective: InPassObjective, progress: bool = True) -> InPassOutcome:
    """Phases A and B (module doc). Ties go to the lower layer."""
    settings = objective.settings
    phase_a = {layer: objective.mean([layer]) for layer in tqdm(objective.layers, desc="phase A: selection layer",
                                                                disable=not progress)}
    chosen = [max(phase_a, key=lambda layer: (phase_a[layer], -layer))]
    best = phase_a[chosen[0]]
    phase_b: list[dict[int, float]] = []
    while len(chosen) < settings.max_layers:
        candidates = [layer for layer in objective.layers if layer > chosen[-1]]
        if not candidates:
            break
        scores = {layer: objective.mean([*chosen, layer]) for layer in tqdm(
            candidates, desc=f"phase B: re-selection layer {len(chosen)}", disable=not progress)}
        phase_b.append(scores)
        pick = max(scores, key=lambda layer: (scores[layer], -layer))
        if scores[pick] < best + settings.min_gain:
            break
        chosen.append(pick)
        best = scores[pick]
    by_budget = {b: objective.score(chosen, b) for b in settings.budgets}
    return InPassOutcome(tuple(chosen), best, phase_a, phase_b, by_budget)
