"""ARR metrics (Eq. 1-4), selection policies and teacher-forced traces, against hand computations and references."""

from __future__ import annotations

import itertools

import pytest
import torch

from trtllm_dustin.attention import get_backend
from trtllm_dustin.dustin_config import LayerHeads
from trtllm_dustin.models import load_model
from trtllm_dustin.plugins.reference import srh_score_ref
from trtllm_dustin.search.arr import ARREvaluator, arr, future_average, normalise_context, oracle_indices, windowed_arr
from trtllm_dustin.search.arr_kl import ARRKLSettings, arr_kl_points, pearson
from trtllm_dustin.search.attention_probe import capture_queries, head_attention
from trtllm_dustin.search.attention_trace import AttentionTrace, TraceSettings, collect_trace

POLICY_KWARGS = {
    "target_history": {"target_layers": [0]},
    "draft_lookahead": {"draft_layers": [1]},
    "hybrid_m0": {"target_layers": [0], "draft_layers": [1], "m": 0},
    "hybrid_mid": {"target_layers": [0, 2], "draft_layers": [0, 1], "m": 7},
    "streaming": {},
}


def test_windowed_arr_matches_a_hand_computation() -> None:
    # One step, committed length L = 3, a window of w = 2 queries; column 3 is a new token (never selectable).
    attention = torch.tensor([[[0.5, 0.3, 0.1, 0.1]], [[0.2, 0.2, 0.4, 0.2]]])  # [w, R, S]
    seqlens = torch.tensor([3], dtype=torch.int32)
    chosen = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    # Renormalised over [0, 3): query 0 keeps (0.5 + 0.1) / 0.9, query 1 keeps (0.2 + 0.4) / 0.8.
    expected = ((0.5 + 0.1) / 0.9 + (0.2 + 0.4) / 0.8) / 2
    assert windowed_arr(attention, seqlens, chosen).item() == pytest.approx(expected)
    assert arr(future_average(attention, seqlens), chosen).item() == pytest.approx(expected)  # Eq. 4 == Eq. 2
    assert oracle_indices(future_average(attention, seqlens), seqlens, 2).tolist() == [[0, 2]]


def test_oracle_is_the_best_k_subset_by_brute_force() -> None:
    gen = torch.Generator().manual_seed(1)
    seqlens = torch.tensor([7, 5, 6], dtype=torch.int32)
    future = normalise_context(torch.rand(3, 8, generator=gen), seqlens)
    for k in (1, 3, 4):
        got = arr(future, oracle_indices(future, seqlens, k))
        for r, L in enumerate(seqlens.tolist()):
            best = max(float(future[r, list(c)].sum()) for c in itertools.combinations(range(L), min(k, L)))
            assert got[r].item() == pytest.approx(best)


def test_arr_of_the_full_context_is_one() -> None:
    gen = torch.Generator().manual_seed(2)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    attention = torch.rand(4, 2, 12, generator=gen)
    everything = torch.where(torch.arange(12)[None, :] < seqlens[:, None], torch.arange(12), -1).to(torch.int32)
    assert torch.allclose(windowed_arr(attention, seqlens, everything), torch.ones(2))


def _random_trace(window: int = 96, steps: int = 12, seed: int = 0) -> AttentionTrace:
    """A trace of random attention with the shapes and masks collect_trace produces (3 target, 2 draft layers)."""
    gen = torch.Generator().manual_seed(seed)
    s = TraceSettings(window=window, steps=steps, gamma=3, max_delta=4, documents=2)
    R, S = s.documents * steps, window
    seqlens = (s.first_length + torch.arange(steps)).repeat(s.documents).to(torch.int32)
    context = torch.arange(S)[None, :] < seqlens[:, None]
    truth = torch.stack([normalise_context(torch.rand(R, S, generator=gen) ** 4, seqlens) for _ in range(3)])
    maps = torch.rand(3, s.documents, s.captured, S, generator=gen)
    draft = torch.rand(2, R, S, generator=gen) * context
    return AttentionTrace(s, ("a", "b"), tuple(LayerHeads(i, (0, 1)) for i in range(3)),
                          tuple(LayerHeads(i, (0,)) for i in range(2)), seqlens, truth, maps, draft)


@pytest.mark.parametrize("budget", [21, 30, 47, 80])
def test_oracle_bounds_every_policy_and_sets_are_valid(budget: int) -> None:
    evaluator = ARREvaluator(_random_trace())
    oracle = arr(evaluator.trace.truth, evaluator.indices("oracle", budget))
    L = evaluator.trace.seqlens.long()
    for name, kwargs in POLICY_KWARGS.items():
        policy = "hybrid" if name.startswith("hybrid") else name
        kwargs = {**kwargs, "m": min(kwargs["m"], budget - evaluator.protected)} if "m" in kwargs else kwargs
        chosen = evaluator.indices(policy, budget, **kwargs)
        assert chosen.shape == (len(L), budget)
        for r in range(len(L)):
            valid = chosen[r][chosen[r] >= 0]
            assert len(set(valid.tolist())) == len(valid) and int(valid.max()) < L[r]  # unique, inside [0, L)
        got = arr(evaluator.trace.truth, chosen)
        assert (got <= oracle + 1e-6).all(), name  # Eq. 3: no k-subset beats the oracle, step by step
        per_layer = evaluator.score_by_layer(policy, budget, **kwargs)
        assert sum(per_layer) / len(per_layer) == pytest.approx(evaluator.score(policy, budget, **kwargs), rel=1e-5)


def test_every_policy_recovers_everything_when_the_budget_covers_the_context() -> None:
    evaluator = ARREvaluator(_random_trace(window=64, steps=8))
    budget = 64  # >= every committed length
    for name, kwargs in POLICY_KWARGS.items():
        assert evaluator.score("hybrid" if name.startswith("hybrid") else name, budget, **kwargs) == pytest.approx(1.0)
    assert evaluator.oracle(budget) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def tiny_pair_trace():
    target = load_model("preset:tiny-llama", seed=3).model
    draft = load_model("preset:tiny-llama-draft", seed=4).model
    settings = TraceSettings(window=80, steps=6, gamma=3, max_delta=3, documents=2, chunk=32)
    gen = torch.Generator().manual_seed(5)
    windows = [(f"doc{i}", torch.randint(0, 257, (80,), generator=gen).tolist()) for i in range(2)]
    t_srh = (LayerHeads(0, (1, 4)), LayerHeads(2, (0, 3, 5)))
    d_srh = (LayerHeads(1, (2, 0)),)
    trace = collect_trace(target, t_srh, windows, settings, draft, d_srh, progress=False)
    return target, draft, windows, trace


def test_trace_scores_equal_the_runtime_srh_score_reference(tiny_pair_trace) -> None:
    target, draft, windows, trace = tiny_pair_trace
    s = trace.settings
    backend = get_backend("reference")
    tokens = torch.tensor([windows[0][1]])
    row = 2  # step 2 of document 0: committed length L
    L = s.first_length + row
    t_cap = capture_queries(target, backend, tokens, [0, 2], s.captured)
    d_cap = capture_queries(draft, backend, tokens, [1], s.captured)
    first = s.window - s.captured  # position of captured query 0
    for delta in (1, 3):  # S_target: the query at L - δ, context j < L - δ, summed over both layers' SRHs
        q_pos = L - delta - first
        expected = sum(srh_score_ref(t_cap.queries[lh.layer][:, q_pos: q_pos + 1], t_cap.cache.k[lh.layer],
                                     torch.tensor([L - delta], dtype=torch.int32), lh.heads)
                       for lh in trace.target_srh)
        torch.testing.assert_close(trace.target_history([0, 2], delta)[row], expected[0], rtol=1e-4, atol=1e-6)
    q_pos = L - first  # S_draft: the Γ lookahead queries at L .. L+Γ-1 over j < L
    expected = srh_score_ref(d_cap.queries[1][:, q_pos: q_pos + s.gamma], d_cap.cache.k[1],
                             torch.tensor([L], dtype=torch.int32), (2, 0))
    torch.testing.assert_close(trace.draft_lookahead([1])[row], expected[0], rtol=1e-4, atol=1e-6)
    # Ā: per-head attention of the Γ+1 verification queries renormalised over [0, L), averaged over heads/queries.
    probs = head_attention(t_cap.queries[2][:, L - first: L - first + s.gamma + 1], t_cap.cache.k[2],
                           torch.arange(L, L + s.gamma + 1)[None], (0, 3, 5))[0, :, :, :L]
    expected = (probs / probs.sum(-1, keepdim=True)).mean((0, 1))
    torch.testing.assert_close(trace.truth_by_layer[1, row, :L], expected, rtol=1e-4, atol=1e-6)
    assert torch.allclose(trace.truth.sum(-1), torch.ones(len(trace.seqlens)), atol=1e-5)


def test_trace_round_trips_through_a_file(tiny_pair_trace, tmp_path) -> None:
    trace = tiny_pair_trace[3]
    trace.save(tmp_path / "t.pt")
    again = AttentionTrace.load(tmp_path / "t.pt")
    assert again.settings == trace.settings and again.target_srh == trace.target_srh
    assert torch.equal(again.truth_by_layer, trace.truth_by_layer) and torch.equal(again.draft_maps, trace.draft_maps)


def test_pearson_on_hand_examples() -> None:
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_arr_kl_points_span_arr_and_have_nonnegative_kl() -> None:
    model = load_model("preset:tiny-llama", seed=6).model
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 257, (120,), generator=gen).tolist()
    settings = ARRKLSettings(budget=40, new_tokens=6, temperatures=(-8.0, 0.0, 8.0), samples_per_temperature=2,
                             chunk=64)
    points = arr_kl_points(model, [prompt], settings, (LayerHeads(1, (0, 2)),), progress=False)
    assert len(points) == 6
    assert all(p.kl >= -1e-9 and 0.0 < p.arr_all < 1.0 and 0.0 < p.arr_srh < 1.0 for p in points)
    by_t = {t: [p.arr_all for p in points if p.temperature == t] for t in settings.temperatures}
    assert min(by_t[8.0]) > max(by_t[-8.0])  # the sampler spans ARR as intended
