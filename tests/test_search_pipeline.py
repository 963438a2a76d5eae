"""The whole offline search on tiny presets: traces -> ARR -> Algorithm 1 -> a config the runtime accepts; plots."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.models import load_model
from trtllm_dustin.search.algorithm import SearchRecord, SearchSettings, dustin_config, run_search
from trtllm_dustin.search.arr import ARREvaluator
from trtllm_dustin.search.attention_trace import TraceSettings, collect_trace
from trtllm_dustin.search.plots import plot_arr_kl, plot_arr_vs_budget, plot_layerwise, plot_srh_scores


@pytest.fixture(scope="module")
def evaluator() -> tuple[ARREvaluator, object, object]:
    target = load_model("preset:tiny-llama", seed=11).model
    draft = load_model("preset:tiny-llama-draft", seed=12).model
    settings = TraceSettings(window=120, steps=10, gamma=3, max_delta=2, documents=2, chunk=64)
    gen = torch.Generator().manual_seed(13)
    windows = [(f"doc{i}", torch.randint(0, 257, (120,), generator=gen).tolist()) for i in range(2)]
    t_srh = tuple(LayerHeads(layer, (0, 3)) for layer in range(3))
    d_srh = tuple(LayerHeads(layer, (1, 2)) for layer in range(2))
    trace = collect_trace(target, t_srh, windows, settings, draft, d_srh, progress=False)
    return ARREvaluator(trace), target, draft


def test_search_over_real_traces_writes_a_config_the_runtime_accepts(evaluator, tmp_path) -> None:
    arr, target, draft = evaluator
    settings = SearchSettings(budget=64, search_budgets=(32, 48), max_draft_layers=2, trials=6, seed=0)
    outcome = run_search(arr, settings, progress=False)
    expected = {t: sum(arr.target_history([t], b) for b in (32, 48)) / 2 for t in arr.target_layers}
    assert outcome.phase1 == pytest.approx(expected)
    assert outcome.target_layer == max(expected, key=expected.get)
    assert 1 <= len(outcome.draft_layers) <= 2 and 0 <= outcome.m <= 64 - 20
    assert outcome.arr == pytest.approx(arr.hybrid([outcome.target_layer], outcome.draft_layers, 64, outcome.m))
    assert outcome.arr <= arr.oracle(64) + 1e-6
    config = dustin_config(outcome, settings, arr.trace.target_srh, arr.trace.draft_srh, target.config, draft.config)
    config.save(tmp_path / "dustin.json")
    DustinConfig.load(tmp_path / "dustin.json").check_models(target.config, draft.config)
    record = SearchRecord(settings, outcome, config, {"64": {"oracle": arr.oracle(64)}}, {"windows": 2},
                          {"phase1": 0.1}, "tiny presets")
    record.save(tmp_path / "record.json")
    data = json.loads((tmp_path / "record.json").read_text())
    assert data["schema_version"] == 1 and data["config"]["m"] == outcome.m
    assert len(data["outcome"]["phase1"]) == 3 and len(data["outcome"]["phase3"]) == 6


def test_plots_are_written_as_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = [
        plot_arr_vs_budget([32, 64, 128], {"oracle": [0.5, 0.7, 0.9], "target_history_d1": [0.4, 0.6, 0.8],
                                           "target_history_d4": [0.3, 0.5, 0.7], "hybrid": [0.45, 0.65, 0.85]},
                           tmp_path / "a.png", "test"),
        plot_layerwise({"T": ([0, 1, 2], [0.5, 0.6, 0.4], 3), "D": ([0, 1], [0.3, 0.2], 2)}, tmp_path / "b.png", "t"),
        plot_arr_kl([0.2, 0.5, 0.9], [1.0, 0.3, 0.01], tmp_path / "c.png", "t"),
        plot_srh_scores([[0.1, None], [0.3, 0.2]], tmp_path / "d.png", "t"),
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_defaults_and_errors(tmp_path, capsys) -> None:
    from trtllm_dustin.search.cli import build_parser, main

    args = build_parser().parse_args(["search", "--draft", "preset:x", "--out", str(tmp_path / "d.json")])
    assert (args.budget, args.search_budgets, args.max_draft_layers, args.trials, args.gamma) == (
        512, [128, 192, 256], 3, 40, 3)
    code = main(["search", "--target", "preset:tiny-llama", "--draft", "preset:tiny-llama-draft",
                 "--out", str(tmp_path / "d.json"), "--device", "cpu"])
    assert code == 2 and "has no tokenizer" in capsys.readouterr().err
    code = main(["srh", "--model", "preset:tiny-llama", "--out", str(tmp_path / "s.json"), "--device", "cpu"])
    assert code == 2 and "--tokenizer-from" in capsys.readouterr().err
