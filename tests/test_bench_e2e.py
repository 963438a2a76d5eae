"""benchmarks/bench_e2e.py on tiny shapes on the CPU, and the stated-distribution acceptance it times rounds with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.speculative import DTYPE, GAMMA, PROMPTS, S_MAX

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.methods import METHODS, MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_e2e  # noqa: E402
from stated_acceptance import StatedAcceptor, stated_acceptance  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_references")


@pytest.mark.parametrize("tau,gamma", [(2.8, 3), (2.2, 3), (1.0, 2), (5.0, 4)])
def test_stated_acceptance_has_the_stated_mean(tau: float, gamma: int) -> None:
    probs, alpha = stated_acceptance(tau, gamma)
    assert probs.shape == (gamma + 1,) and abs(float(probs.sum()) - 1) < 1e-9 and 0 <= alpha <= 1
    assert abs(sum((n + 1) * float(p) for n, p in enumerate(probs)) - tau) < 1e-6
    with pytest.raises(ValueError, match=r"--tau 9.0 must be in \[1, gamma \+ 1"):
        stated_acceptance(9.0, gamma)


def test_the_stated_acceptor_commits_the_drawn_counts_and_the_targets_next_token() -> None:
    """With P(accepted = Γ) = 1 every round commits Γ + 1 tokens, the drafts first, whatever the models agree on."""
    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=DTYPE, seed=8).model
    setup = MethodSetup(target=target, target_cache=KVCache.allocate(target.config, 4, S_MAX, DTYPE, "cpu"),
                        backend=get_backend("reference"), draft=draft, gamma=GAMMA,
                        draft_cache=KVCache.allocate(draft.config, 4, S_MAX, DTYPE, "cpu"))
    decoder = build_decoder("classic", setup)
    progress = Progress.allocate(4, 21, GAMMA, (), torch.device("cpu"))
    sampling = SlotSampling.batch(SamplingParams(), 4, torch.device("cpu"))
    with torch.inference_mode():
        logits = decoder.prefill(slice(0, 4), PROMPTS, 32)
        decoder.begin(progress, slice(0, 4), logits.argmax(-1), PROMPTS, 21)
        acceptor = StatedAcceptor(torch.tensor([0.0, 0.0, 0.0, 1.0]))
        for _ in range(5):
            drafts = decoder.drafter.tokens
            before = progress.generated.clone()
            verdict = decoder.round(progress, sampling, acceptor)
            committed = progress.out.gather(1, before[:, None] + torch.arange(GAMMA + 1)[None])
            assert torch.equal(committed[:, :GAMMA], drafts) and verdict.accepted.tolist() == [GAMMA] * 4
    assert progress.hist.tolist() == [0, 0, 0, 4 * 5] and progress.generated.tolist() == [21] * 4


def test_method_names_come_from_the_registry() -> None:
    for name, method in METHODS.items():
        assert bench_e2e.split_method(name) == (name, False)
        if method.needs_draft:
            assert bench_e2e.split_method(name + "+fp8kv") == (name, True)
    with pytest.raises(SystemExit, match="vanilla\\+fp8kv has no draft"):
        bench_e2e.split_method("vanilla+fp8kv")
    with pytest.raises(SystemExit, match="'medusa' is not a registered method"):
        bench_e2e.split_method("medusa")


def test_bench_e2e_runs_every_default_method_on_tiny_shapes(tmp_path: Path) -> None:
    out = tmp_path / "e2e_tiny.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--batches", "2",
                    "--contexts", "40,72", "--rounds", "2", "--device", "cpu", "--out", str(out)], check=True, env=env,
                   cwd=BENCHMARKS, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = {(r["method"], r["context"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in bench_e2e.DEFAULT_METHODS for c in (40, 72)}
    for (method, _), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["ms_per_round"] > 0 and row["speedup_vs_vanilla"] > 0
        if method == "vanilla":
            # no floor on the CPU: the only measured copy ceiling is the H200's, and another device's is not quoted
            assert row["speedup_vs_vanilla"] == 1 and row["fraction_of_floor"] is None and row["tau_realized"] == 1
        else:
            assert row["tau_stated"] == 2.8 and 1 <= row["tau_realized"] <= GAMMA + 1
            assert set(row["phase_ms_per_round"]) >= {"draft", "verify", "accept"}
    assert json.loads(json.dumps(result["kernels"]))["round_kernels"] is True
    assert out.with_suffix(".csv").read_text().startswith("batch,context,method,budget,tokens_per_s")


def test_budget_runs_every_sparse_method_at_each_k_and_full_ones_once(tmp_path: Path) -> None:
    out = tmp_path / "e2e_budgets.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--batches", "2",
                    "--contexts", "72", "--rounds", "2", "--device", "cpu", "--methods",
                    "vanilla,classic,dustin-h,dustin-h-sparse-draft", "--budget", "24,40", "--out", str(out)],
                   check=True, env=env, cwd=BENCHMARKS, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert sorted((r["method"], r["budget"] or 0) for r in result["rows"]) == [
        ("classic", 0), ("dustin-h", 24), ("dustin-h", 40), ("dustin-h-sparse-draft", 24),
        ("dustin-h-sparse-draft", 40), ("vanilla", 0)]
    assert result["budgets"] == [24, 40]
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--budget", "10",
                          "--device", "cpu"], env=env, cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--budget 10" in bad.stderr and "sinks + recent window = 12" in bad.stderr


def test_rows_run_with_int8_drafter_weights(tmp_path: Path) -> None:
    """--draft-weights int8 / --ring-weights int8: the classic rows run with the draft's layers in weight-only int8,
    the ring rows with the ring drafter's layers and subset head in int8, and the JSON says so."""
    out = tmp_path / "e2e_int8.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--batches", "2",
                    "--contexts", "72", "--rounds", "3", "--device", "cpu", "--methods", "classic,ring", "--gamma",
                    "5", "--draft-weights", "int8", "--ring-weights", "int8", "--ring-head-ids", "64", "--out",
                    str(out)], check=True, env=env, cwd=BENCHMARKS, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert (result["draft_weights"], result["ring_weights"], result["ring_head_ids"]) == ("int8", "int8", 64)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"classic", "ring"} and rows["ring"]["drafter_state_bytes"] > 0
    assert all(r["ms_per_round"] > 0 and r["phase_ms_per_round"]["draft"] > 0 for r in rows.values())


def test_gamma_sets_every_methods_round(tmp_path: Path) -> None:
    """--gamma 5 (every drafter, the ring drafter's too): the stated tau is drawn over 6 outcomes (rounds can commit up
    to 6), recorded in the JSON; a Γ whose rounds cannot reach the stated tau, or past LongSpark's block, is refused
    before the models load."""
    out = tmp_path / "e2e_gamma.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--batches", "2",
                    "--contexts", "72", "--rounds", "6", "--device", "cpu", "--methods",
                    "vanilla,classic,dustin-h-longspark,ring", "--gamma", "5", "--tau", "5.9", "--out", str(out)],
                   check=True, env=env, cwd=BENCHMARKS, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["gamma"] == 5
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["ring"]["drafter_state_bytes"] > 0  # the ring drafter's rounds ran beside the others
    for method in ("classic", "dustin-h-longspark", "ring"):
        # 12 draws (2 slots x 6 rounds) of a mean-5.9 distribution over 1..6 (P(6) = 0.967): their mean is past Γ =
        # 3's cap of 4 (a mean <= 4 came up in none of 200,000 simulated runs) and never past 6
        assert rows[method]["tau_stated"] == 5.9 and 4 < rows[method]["tau_realized"] <= 6
    for flags, message in ((["--gamma", "1"], "--gamma 1: a stated tau of 2.80 cannot be reached"),
                           (["--gamma", "8"], "--gamma 8 must be in [1, 7]")):
        bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--device", "cpu",
                              *flags], env=env, cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]


def test_stated_tau_is_the_papers_per_method() -> None:
    llama = bench_e2e.PAIRS["llama-8b"]
    assert [llama.stated_tau(m) for m in ("classic", "magicdec", "dustin-h", "dustin-h-sparse-draft")] == \
        [2.7, 2.6, 2.8, 2.8]
    assert bench_e2e.PAIRS["qwen-7b"].stated_tau("classic") == 2.2


def test_pipeline_mode_runs_the_methods_over_two_processes(tmp_path: Path) -> None:
    """--pp 2 on the CPU (gloo): the script starts its two ranks, each times its own stage (the lighter first stage of
    --first-stage-layers 1; the LongSpark drafter on rank 0 with blocks of layers rank 1 holds), and rank 0 writes
    one row per method and budget with every rank's layers, round time
    and phases; the row's tokens/s is B * tau per round time (the slowest rank's), and the stated acceptance's draws
    average near the stated tau."""
    out = tmp_path / "pp.json"
    env = os.environ | {"TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--pp", "2",
                           "--batches", "4", "--contexts", "48,64", "--rounds", "24", "--micro-batches", "2",
                           "--first-stage-layers", "1", "--budget", "24,40", "--methods",
                           "vanilla,classic,dustin-h,dustin-ip-sparse-draft,dustin-h-longspark", "--device", "cpu",
                           "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["pp"] == 2 and data["layer_split"] == [[0, 1], [1, 3]] and data["micro_batches"] == 2
    rows = data["rows"]
    keys = {(r["method"], r["budget"], r["context"]) for r in rows}
    assert keys == {(m, k, c) for c in (48, 64) for m, k in [("vanilla", None), ("classic", None)]
                    + [(m, k) for m in ("dustin-h", "dustin-ip-sparse-draft", "dustin-h-longspark")
                       for k in (24, 40)]}
    for r in rows:
        assert r["rank_layers"] == [[0, 1], [1, 3]] and r["pp"] == 2
        assert r["ms_per_round"] == max(r["rank_ms_per_round"]) > 0
        tau = r.get("tau_stated", 1.0)
        assert abs(r["tokens_per_s"] - 4 * tau / r["ms_per_round"] * 1e3) < 1e-6 * r["tokens_per_s"]
        balanced = r["balanced_first_stage_layers"]
        assert 1 <= balanced["layers"] <= 2 and balanced["layer_ms"] > 0 and balanced["first_extra_ms"] >= 0
        first, last = (set(p) for p in r["rank_phase_ms_per_round"])
        assert {"draft", "forward", "send", "wait", "commit"} <= first and "accept" not in first
        assert {"wait", "forward", "accept", "commit"} <= last and "draft" not in last
        if r["method"] == "vanilla":
            assert r["tau_realized"] == 1.0 and r["speedup_vs_vanilla"] == 1.0
        else:  # 96 draws of the stated distribution (mean 2.8, sd about 1.1): within 0.5 of it
            assert tau == 2.8 and abs(r["tau_realized"] - tau) < 0.5
    assert data["gpus"] == [] and data["git_sha"] and data["command"].startswith("python")


@pytest.mark.parametrize("flags,message", [
    (["--pp", "2", "--methods", "snapkv"], "--methods snapkv: "),
    (["--pp", "2", "--methods", "classic+fp8kv"], "--pp runs the draft cache in the weights' dtype"),
    (["--pp", "2", "--first-stage-layers", "3", "--methods", "classic"],
     "--first-stage-layers 3 must be between 1 and 2"),
    (["--micro-batches", "2", "--methods", "classic"], "--micro-batches and --first-stage-layers split a pipeline"),
    (["--pp", "0"], "--pp 0 must be >= 1"),
])
def test_pipeline_mode_refuses_what_it_cannot_run_before_starting(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_e2e.py"), "--pair", "tiny", "--device", "cpu",
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
