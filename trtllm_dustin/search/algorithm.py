"""Algorithm 1: the sparse-verification configuration search (paper Sec. 4.2.2).

  phase 1  l_t* = argmax_l ARR(TargetHistory(l)) over the target's layers, at the search budgets
  phase 2  greedily add the draft layer d maximising ARR(Hybrid({l_t*} ∪ L_d ∪ {d})) at the search budgets; the
           first is always added (Algorithm 1), later ones only while ARR rises, at most `max_draft_layers`
  phase 3  Optuna (TPE, seeded) tunes the draft share m at the deployment budget k, maximising hybrid ARR; m = 0
           (Dustin-T) and m = k - sinks - window (Dustin-D) are tried first, so the tuned m is never worse than either

The search reads ARR through the small ARRObjective protocol (arr.ARREvaluator over real traces; tests pass
synthetic functions with known optima) and returns the DustinConfig the runtime reads plus a SearchRecord of every
candidate's score and each phase's time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads, model_fingerprint

__all__ = [
    "SEARCH_SCHEMA_VERSION",
    "ARRObjective",
    "SearchOutcome",
    "SearchRecord",
    "SearchSettings",
    "dustin_config",
    "run_search",
]

SEARCH_SCHEMA_VERSION = 1


class ARRObjective(Protocol):
    """Mean windowed ARR of Dustin's selection for given estimator layers (arr.ARREvaluator implements it)."""

    @property
    def target_layers(self) -> tuple[int, ...]: ...

    @property
    def draft_layers(self) -> tuple[int, ...]: ...

    def target_history(self, target_layers: Sequence[int], budget: int) -> float: ...

    def hybrid(self, target_layers: Sequence[int], draft_layers: Sequence[int], budget: int, m: int) -> float: ...


@dataclass(frozen=True)
class SearchSettings:
    budget: int = 512  # k: the deployment budget phase 3 tunes m for (sinks and window included)
    search_budgets: tuple[int, ...] = (128, 192, 256)  # B_search of phases 1-2
    phase2_draft_share: float = 0.5  # m = share * (B - sinks - window) while phase 2 compares draft layers
    max_draft_layers: int = 3  # phase 2 stops here at the latest (the paper ends with 3)
    trials: int = 40  # Optuna trials of phase 3 (m = 0 and m = max are the first two)
    seed: int = 0  # TPE sampler seed
    n_sink: int = 4  # attention sinks, always kept
    n_recent: int = 16  # recent window, always kept
    gamma: int = 3  # Γ the traces were collected for
    study_path: str = ""  # SQLite file of the Optuna study ("" = in memory); an existing study is resumed
    study_name: str = "dustin-m"

    def __post_init__(self) -> None:
        object.__setattr__(self, "search_budgets", tuple(int(b) for b in self.search_budgets))
        protected = self.n_sink + self.n_recent
        for b in (self.budget, *self.search_budgets):
            if b <= protected:
                raise ConfigError(f"budget {b} must exceed sinks + recent window = {protected}")
        if not self.search_budgets:
            raise ConfigError("search_budgets is empty; give at least one (e.g. 128 192 256)")
        if not 0.0 <= self.phase2_draft_share <= 1.0:
            raise ConfigError(f"phase2_draft_share={self.phase2_draft_share} must lie in [0, 1]")
        if self.max_draft_layers < 0 or self.trials < 2 or self.gamma < 1:
            raise ConfigError(f"max_draft_layers={self.max_draft_layers} must be >= 0, trials={self.trials} >= 2 "
                              f"(m = 0 and m = max are always tried), gamma={self.gamma} >= 1")

    @property
    def protected(self) -> int:
        return self.n_sink + self.n_recent


@dataclass(frozen=True)
class SearchOutcome:
    target_layer: int  # l_t*
    draft_layers: tuple[int, ...]  # in the order phase 2 added them
    m: int  # tuned draft share at the deployment budget
    arr: float  # hybrid ARR of the outcome at the deployment budget
    phase1: dict[int, float]  # target layer -> mean ARR at the search budgets
    phase2: list[dict[int, float]]  # per round: draft layer -> mean hybrid ARR with it added
    phase2_baseline: float  # target-history ARR (m = 0) at the search budgets, before any draft layer
    phase3: list[tuple[int, float]]  # (m, ARR) of every Optuna trial in order
    seconds: dict[str, float]  # wall time of each phase


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _phase2_m(settings: SearchSettings, budget: int) -> int:
    return round(settings.phase2_draft_share * (budget - settings.protected))


def run_search(objective: ARRObjective, settings: SearchSettings, progress: bool = True) -> SearchOutcome:
    """Algorithm 1 over `objective`. Deterministic for a fixed seed (TPE is seeded and runs sequentially)."""
    seconds: dict[str, float] = {}
    budgets = settings.search_budgets
    if not objective.target_layers:
        raise ConfigError("no target layer to search; the target's SRH file lists none")

    start = time.perf_counter()  # phase 1
    phase1 = {}
    for layer in tqdm(objective.target_layers, desc="phase 1: target layer", disable=not progress):
        phase1[layer] = _mean([objective.target_history([layer], b) for b in budgets])
    target_layer = max(phase1, key=lambda layer: (phase1[layer], -layer))
    seconds["phase1"] = time.perf_counter() - start

    start = time.perf_counter()  # phase 2
    chosen: list[int] = []
    best = phase2_baseline = _mean([objective.target_history([target_layer], b) for b in budgets])
    rounds: list[dict[int, float]] = []
    while len(chosen) < min(settings.max_draft_layers, len(objective.draft_layers)):
        candidates = [d for d in objective.draft_layers if d not in chosen]
        scores = {d: _mean([objective.hybrid([target_layer], [*chosen, d], b, _phase2_m(settings, b))
                            for b in budgets])
                  for d in tqdm(candidates, desc=f"phase 2: draft layer {len(chosen) + 1}", disable=not progress)}
        rounds.append(scores)
        pick = max(scores, key=lambda d: (scores[d], -d))
        if chosen and scores[pick] <= best:  # the first draft layer is always taken (Algorithm 1)
            break
        chosen.append(pick)
        best = scores[pick]
    seconds["phase2"] = time.perf_counter() - start

    start = time.perf_counter()  # phase 3
    trials: list[tuple[int, float]] = []
    m, final = 0, objective.target_history([target_layer], settings.budget)
    if chosen:
        m, final, trials = _tune_m(objective, target_layer, chosen, settings, progress)
    seconds["phase3"] = time.perf_counter() - start
    return SearchOutcome(target_layer, tuple(chosen), m, final, phase1, rounds, phase2_baseline, trials,
                         {k: round(v, 3) for k, v in seconds.items()})


def _tune_m(objective: ARRObjective, target_layer: int, draft_layers: Sequence[int], settings: SearchSettings,
            progress: bool) -> tuple[int, float, list[tuple[int, float]]]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    free = settings.budget - settings.protected
    storage = f"sqlite:///{Path(settings.study_path).resolve()}" if settings.study_path else None
    study = optuna.create_study(study_name=settings.study_name, storage=storage, load_if_exists=True,
                                direction="maximize", sampler=optuna.samplers.TPESampler(seed=settings.seed))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        study.enqueue_trial({"m": 0})  # Dustin-T
        study.enqueue_trial({"m": free})  # Dustin-D
    values: dict[int, float] = {}

    def evaluate(trial: optuna.Trial) -> float:
        m = trial.suggest_int("m", 0, free)
        if m not in values:
            values[m] = objective.hybrid([target_layer], draft_layers, settings.budget, m)
        return values[m]

    remaining = max(0, settings.trials - len(done))
    with tqdm(total=remaining, desc="phase 3: Optuna over m", disable=not progress) as bar:
        study.optimize(evaluate, n_trials=remaining, callbacks=[lambda study, trial: bar.update()])
    trials = [(int(t.params["m"]), float(t.value)) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best_value = max(v for _, v in trials)
    best_m = min(m for m, v in trials if v == best_value)  # ties: the smaller draft share
    return best_m, best_value, trials


def dustin_config(outcome: SearchOutcome, settings: SearchSettings, target_srh: Sequence[LayerHeads],
                  draft_srh: Sequence[LayerHeads], target: ModelConfig, draft: ModelConfig) -> DustinConfig:
    """The runtime's config: l_t* and the chosen draft layers with their SRHs, k, m, sinks, window, Γ, fingerprints."""
    t_heads = {lh.layer: lh.heads for lh in target_srh}
    d_heads = {lh.layer: lh.heads for lh in draft_srh}
    return DustinConfig(target_layers=(LayerHeads(outcome.target_layer, t_heads[outcome.target_layer]),),
                        draft_layers=tuple(LayerHeads(d, d_heads[d]) for d in outcome.draft_layers),
                        budget=settings.budget, m=outcome.m, n_sink=settings.n_sink, n_recent=settings.n_recent,
                        gamma=settings.gamma, target_fingerprint=model_fingerprint(target),
                        draft_fingerprint=model_fingerprint(draft))


@dataclass(frozen=True)
class SearchRecord:
    """Everything a search measured: every candidate's score, the ARR table, data, seeds, time per phase."""

    settings: SearchSettings
    outcome: SearchOutcome
    config: DustinConfig
    arr_table: dict[str, dict[str, float]] = field(default_factory=dict)  # budget -> policy -> ARR
    data: dict[str, Any] = field(default_factory=dict)  # models, SRH files, validation windows
    seconds: dict[str, float] = field(default_factory=dict)  # SRH, attention collection, the phases, total
    note: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        outcome = asdict(self.outcome)
        outcome["phase1"] = [{"layer": k, "arr": round(v, 6)} for k, v in self.outcome.phase1.items()]
        outcome["phase2"] = [[{"layer": k, "arr": round(v, 6)} for k, v in r.items()] for r in self.outcome.phase2]
        outcome["phase3"] = [{"m": m, "arr": round(v, 6)} for m, v in self.outcome.phase3]
        payload = {"schema_version": SEARCH_SCHEMA_VERSION, "note": self.note, "provenance": self.provenance,
                   "settings": asdict(self.settings), "config": json.loads(self.config.to_json()),
                   "outcome": outcome, "arr_table": self.arr_table, "data": self.data, "seconds": self.seconds}
        return json.dumps(payload, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")
