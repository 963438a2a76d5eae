"""Algorithm 1 on synthetic ARR functions with known optima, its determinism and resume, and the config it writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads, model_fingerprint
from trtllm_dustin.models import get_preset
from trtllm_dustin.search.algorithm import SearchSettings, dustin_config, run_search

BEST_M = 137  # the synthetic hybrid ARR peaks here at the deployment budget (k = 512, 492 free slots)


@dataclass
class SyntheticObjective:
    """ARR as a known function: target layer 3 is best; draft layers add fixed gains; m has one smooth optimum."""

    target_quality: dict[int, float] = field(default_factory=lambda: {0: 0.50, 1: 0.61, 2: 0.58, 3: 0.70, 4: 0.66})
    draft_gain: dict[int, float] = field(default_factory=lambda: {0: 0.010, 1: 0.030, 2: 0.050, 3: -0.02, 4: 0.002})
    layer_cost: float = 0.005  # each draft layer costs this much ARR (so a weak layer does not pay for itself)
    calls: list[tuple] = field(default_factory=list)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.target_quality)

    @property
    def draft_layers(self) -> tuple[int, ...]:
        return tuple(self.draft_gain)

    def target_history(self, target_layers: Sequence[int], budget: int) -> float:
        self.calls.append(("t", tuple(target_layers), budget))
        return sum(self.target_quality[t] for t in target_layers) + budget * 1e-5

    def hybrid(self, target_layers: Sequence[int], draft_layers: Sequence[int], budget: int, m: int) -> float:
        self.calls.append(("h", tuple(target_layers), tuple(draft_layers), budget, m))
        gains = sum(self.draft_gain[d] - self.layer_cost for d in draft_layers)
        share = m / BEST_M if budget == 512 else 1.0
        return self.target_history(target_layers, budget) + gains * (1.0 - 0.5 * (share - 1.0) ** 2) + 0.001


def _settings(tmp_path=None, **overrides) -> SearchSettings:
    values = dict(budget=512, search_budgets=(128, 192, 256), max_draft_layers=3, trials=40, seed=0,
                  study_path=str(tmp_path / "study.sqlite3") if tmp_path else "")
    values.update(overrides)
    return SearchSettings(**values)


def test_phases_find_the_known_optima() -> None:
    objective = SyntheticObjective()
    outcome = run_search(objective, _settings(), progress=False)
    assert outcome.target_layer == 3  # phase 1: the best target layer
    assert outcome.phase1 == pytest.approx({t: q + 192e-5 for t, q in objective.target_quality.items()})
    # Phase 2: layer 2 (gain .05) then 1 (.03) then 0 (.01) each rise ARR by gain - cost > 0; layer 4 (.002) would
    # lower it, but max_draft_layers = 3 stops first.
    assert outcome.draft_layers == (2, 1, 0)
    assert [len(r) for r in outcome.phase2] == [5, 4, 3]
    assert abs(outcome.m - BEST_M) <= 12  # phase 3: TPE finds the smooth optimum within tolerance
    assert outcome.phase3[0][0] == 0 and outcome.phase3[1][0] == 492  # Dustin-T and Dustin-D tried first
    assert len(outcome.phase3) == 40 and outcome.arr == max(v for _, v in outcome.phase3)
    assert set(outcome.seconds) == {"phase1", "phase2", "phase3"}


def test_phase2_stops_when_no_layer_improves() -> None:
    objective = SyntheticObjective(draft_gain={0: 0.004, 1: 0.03, 2: 0.002})
    outcome = run_search(objective, _settings(max_draft_layers=3, trials=5), progress=False)
    assert outcome.draft_layers == (1,)  # round 2's best (gain .004 < cost .005) lowers ARR: stop
    assert len(outcome.phase2) == 2


def test_the_first_draft_layer_is_always_added_and_phase3_can_fall_back_to_target_only() -> None:
    objective = SyntheticObjective(draft_gain={0: -0.1, 1: -0.2})  # a useless draft (like a random one)
    outcome = run_search(objective, _settings(trials=6), progress=False)
    assert outcome.draft_layers == (0,)  # Algorithm 1 adds one draft layer whatever its score
    # m = 0 (Dustin-T) and m = max (Dustin-D) are always tried, so the tuned split is never worse than either.
    assert outcome.arr >= max(objective.hybrid([3], [0], 512, 0), objective.hybrid([3], [0], 512, 492))
    assert outcome.arr == pytest.approx(max(v for _, v in outcome.phase3))


def test_search_is_deterministic_for_a_seed() -> None:
    first = run_search(SyntheticObjective(), _settings(trials=25, seed=7), progress=False)
    second = run_search(SyntheticObjective(), _settings(trials=25, seed=7), progress=False)
    assert first.phase3 == second.phase3 and first.m == second.m and first.draft_layers == second.draft_layers


def test_optuna_study_resumes_from_sqlite(tmp_path) -> None:
    first = run_search(SyntheticObjective(), _settings(tmp_path, trials=8), progress=False)
    resumed = run_search(SyntheticObjective(), _settings(tmp_path, trials=20), progress=False)
    assert len(first.phase3) == 8 and len(resumed.phase3) == 20
    assert resumed.phase3[:8] == first.phase3  # the stored trials are kept, 12 new ones run


def test_written_config_loads_and_passes_check_models(tmp_path) -> None:
    target, draft = get_preset("smollm2-135m"), get_preset("smollm2-draft-random")  # 30 and 4 layers
    objective = SyntheticObjective(draft_gain={0: 0.01, 1: 0.03, 2: 0.05, 3: 0.02})
    outcome = run_search(objective, _settings(trials=5), progress=False)
    t_srh = tuple(LayerHeads(layer, (8, 1, 2, 0)) for layer in range(30))
    d_srh = tuple(LayerHeads(layer, (3, 1, 0, 2)) for layer in range(4))
    config = dustin_config(outcome, _settings(), t_srh, d_srh, target, draft)
    config.save(tmp_path / "dustin.json")
    loaded = DustinConfig.load(tmp_path / "dustin.json")
    assert loaded == config
    assert loaded.target_layers == (LayerHeads(3, (8, 1, 2, 0)),) and loaded.m == outcome.m
    assert [lh.layer for lh in loaded.draft_layers] == list(outcome.draft_layers) == [2, 1, 3]
    assert (loaded.budget, loaded.n_sink, loaded.n_recent, loaded.gamma) == (512, 4, 16, 3)
    loaded.check_models(target, draft)
    assert loaded.target_fingerprint == model_fingerprint(target)
    with pytest.raises(ConfigError, match="another target"):  # the runtime refuses a config of another pair
        loaded.check_models(get_preset("tiny-llama"), draft)


def test_search_settings_refuse_bad_values() -> None:
    with pytest.raises(ConfigError, match="must exceed"):
        SearchSettings(search_budgets=(16,))
    with pytest.raises(ConfigError, match="trials"):
        SearchSettings(trials=1)
    with pytest.raises(ConfigError, match="share"):
        SearchSettings(phase2_draft_share=1.5)
