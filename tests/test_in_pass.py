"""In-pass selection (runtime/selectors/in_pass.py, issue 35) against independent references and its invariants.

- the page key ranges and Quest's page bounds against float64 loops; a bound is never below any q.k of its page;
- the set a selection layer chooses is sinks + the top of the float64 attention of the verified queries + the recent
  window, distinct, inside [0, L); the pre-pass moves the recent window without a duplicate;
- the verification pass reads only what it should: the layers before the selection layer the pre-pass set, the
  selection layer and after it the chosen set (everything else poisoned with NaN), and with dense layers the full
  cache before it; a re-selection layer chooses again from its own queries;
- decoding: k >= every length equals vanilla (also test_speculative's registry-wide test) for every variant and with
  sparse drafting; the Triton kernels (interpreted on the CPU) decode what the references decode;
- the selection-layer search finds the layer whose attention is the truth in a synthetic trace.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import speculative
from helpers.kernels import use_interpreter
from helpers.speculative import DTYPE, GAMMA, PROMPTS, S_MAX, dustin_config, run

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import MethodSetup
from trtllm_dustin.runtime.selectors.in_pass import PAGE, head_weights, page_bounds, page_key_range
from trtllm_dustin.search.attention_trace import AttentionTrace, TraceSettings
from trtllm_dustin.search.in_pass import InPassObjective, InPassSettings, SearchTraces, search_selection_layers

pytestmark = pytest.mark.usefixtures("plugin_references")
env, vanilla_tokens = speculative.env, speculative.vanilla_tokens  # the shared module-scoped fixtures
IN_PASS = ("dustin-ip", "dustin-ip-pages", "dustin-ip-la", "dustin-ip-dense", "dustin-ip-sparse-draft")


# ---- page bounds -----------------------------------------------------------------------------------------------------
def test_page_key_range_and_bounds_match_loops() -> None:
    torch.manual_seed(0)
    B, Hkv, G, T, D, S = 2, 2, 3, 4, 16, 70  # S not a multiple of the page
    keys = torch.randn(B, Hkv, S, D)
    q = torch.randn(B, T, Hkv * G, D)
    lengths = torch.tensor([53, 21], dtype=torch.int32)
    heads = (0, 2, 5)
    low, high = page_key_range(keys, lengths)
    P = -(-S // PAGE)
    expected = torch.zeros(B, P, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        filled = [p for p in range(P) if p * PAGE < L]
        for p in range(P):
            rows = keys[b, :, p * PAGE: min((p + 1) * PAGE, L)].double()  # [H_kv, n, D]
            if p not in filled:
                assert bool((low[b, :, p] == 0).all() and (high[b, :, p] == 0).all())
                continue
            torch.testing.assert_close(low[b, :, p].double(), rows.amin(1))
            torch.testing.assert_close(high[b, :, p].double(), rows.amax(1))
        for h in heads:
            g = h // G
            for t in range(T):
                qd = q[b, t, h].double()
                bound = {p: float(torch.maximum(qd * low[b, g, p].double(), qd * high[b, g, p].double()).sum())
                         for p in filled}
                for p in filled:  # Quest's bound: never below any key's product on its page
                    rows = keys[b, g, p * PAGE: min((p + 1) * PAGE, L)].double()
                    assert bound[p] >= float((rows @ qd).max()) - 1e-9
                top = max(bound.values())
                total = sum(math.exp((v - top) / math.sqrt(D)) for v in bound.values())
                for p in filled:
                    expected[b, p] += math.exp((bound[p] - top) / math.sqrt(D)) / total
    got = page_bounds(q, low, high, lengths, head_weights(heads, Hkv * G, q.device))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


# ---- the chosen set --------------------------------------------------------------------------------------------------
def _true_scores(q: torch.Tensor, k: torch.Tensor, L: int, heads: tuple[int, ...]) -> torch.Tensor:
    """float64 [L]: Eq. 5 of the T queries at L + t over j < L (softmax over [0, L + t]), summed over heads."""
    T, Hq, D = q.shape
    group = Hq // k.shape[0]
    out = torch.zeros(L, dtype=torch.float64)
    for h in heads:
        for t in range(T):
            logits = k[h // group, : L + t + 1].double() @ q[t, h].double() / math.sqrt(D)
            out += torch.softmax(logits, 0)[:L]
    return out


def _decoder(method: str, env, config: DustinConfig, slots: int = 4):
    setup = MethodSetup(target=env.target, target_cache=KVCache.allocate(env.target.config, slots, S_MAX, DTYPE,
                                                                         env.device),
                        backend=get_backend(env.backend), draft=env.draft,
                        draft_cache=KVCache.allocate(env.draft.config, slots, S_MAX, DTYPE, env.device), gamma=GAMMA,
                        dustin=config)
    return build_decoder(method, setup)


def _choose_once(env, config: DustinConfig):
    """Decode a few rounds with `config`, then let selection layer 1 choose from random verification queries ->
    (selector, lengths, q [B, Γ + 1, 6, 16], that layer's k_cache)."""
    decoder, _ = run("dustin-ip", env, dustin=config, max_new=8)
    selector, layer = decoder.selector, 1
    with torch.inference_mode():
        lengths = decoder.state.lengths
        q = torch.randn(len(PROMPTS), GAMMA + 1, 6, 16, device=env.device)
        k_cache = decoder.cache.k[layer]
        selector.choose(layer, q, k_cache, lengths)
    return selector, lengths, q, k_cache


def test_chosen_set_is_the_top_of_the_true_attention(env) -> None:
    budget, n_recent = 28, 8
    selector, lengths, q, k_cache = _choose_once(env, dustin_config(budget=budget, m=4, n_recent=n_recent))
    for b in range(len(PROMPTS)):
        L = int(lengths[b])
        chosen = selector.indices[b].tolist()
        if L <= budget:
            assert chosen == list(range(L)) + [-1] * (budget - L)
            continue
        scores = _true_scores(q[b].cpu(), k_cache[b].cpu(), L, tuple(range(6)))
        free = budget - 4 - n_recent
        candidates = sorted(range(4, L - n_recent), key=lambda j: -float(scores[j]))[:free]
        assert sorted(chosen) == sorted([0, 1, 2, 3, *candidates, *range(L - n_recent, L)])


@pytest.mark.parametrize("width, op", [(5, "max"), (3, "mean")])
def test_a_score_window_chooses_the_top_of_the_windowed_attention(env, width: int, op: str) -> None:
    """With score_window, the free slots hold the positions whose windowed float64 attention is highest: no position
    left out scores above one chosen (ties of the sliding max make the set itself not unique)."""
    budget, n_recent = 28, 8
    config = replace(dustin_config(budget=budget, m=4, n_recent=n_recent), score_window=width, score_window_op=op)
    selector, lengths, q, k_cache = _choose_once(env, config)
    checked = 0
    for b in range(len(PROMPTS)):
        L = int(lengths[b])
        if L <= budget:
            continue
        scores = _true_scores(q[b].cpu(), k_cache[b].cpu(), L, tuple(range(6)))
        half = width // 2
        windowed = [float(scores[max(0, j - half): j + half + 1].max()) if op == "max" else
                    float(scores[max(0, j - half): j + half + 1].sum()) / width for j in range(L)]
        chosen = selector.indices[b].tolist()
        assert len(set(chosen)) == budget and {0, 1, 2, 3, *range(L - n_recent, L)} <= set(chosen)
        free = [j for j in chosen if 4 <= j < L - n_recent]
        left = [j for j in range(4, L - n_recent) if j not in set(free)]
        assert len(free) == budget - 4 - n_recent
        assert min(windowed[j] for j in free) >= max(windowed[j] for j in left) - 1e-6
        checked += 1
    assert checked


def test_pre_pass_moves_the_recent_window_without_a_duplicate(env) -> None:
    budget, n_recent = 28, 8
    decoder, _ = run("dustin-ip", env, dustin=dustin_config(budget=budget, m=4, n_recent=n_recent), max_new=8)
    selector = decoder.selector
    with torch.inference_mode():
        before = selector.indices.clone()
        grown = decoder.state.lengths + 3  # three tokens committed since the choice
        after = selector.select(grown, selector.estimate(grown))
    for b in range(len(PROMPTS)):
        L = int(grown[b])
        valid = [x for x in after[b].tolist() if x >= 0]
        assert len(valid) == min(budget, L) == len(set(valid)) and max(valid) < L
        if L > budget:
            assert after[b, -n_recent:].tolist() == list(range(L - n_recent, L))
            kept = set(before[b, 4: budget - n_recent].tolist())
            assert kept <= set(valid)  # the previous choice stays


# ---- what the pass reads ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["dustin-ip", "dustin-ip-dense"])
def test_the_pass_reads_only_its_sets(env, variant: str) -> None:
    """Layers before the selection layer (1) read the pre-pass set (the full cache with dense layers), layer 1 and 2
    the set layer 1 chooses: poisoning everything else in K and V (layer 1's K is scored over every position, so its
    V only) changes no logit."""
    budget, n_recent = 28, 8
    decoder, _ = run(variant, env, dustin=dustin_config(budget=budget, m=4, n_recent=n_recent), max_new=10)
    selector = decoder.selector
    with torch.inference_mode():
        L = decoder.state.lengths
        pre = selector.select(L, selector.estimate(L)).clone()
        k_saved, v_saved = decoder.cache.k.clone(), decoder.cache.v.clone()
        expected = decoder._verify(decoder.drafter.tokens, selector.indices).clone()
        chosen = selector.indices.clone()
        slots = decoder.cache.batch_slots

        def keep(sets: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(slots, S_MAX, dtype=torch.bool, device=env.device)
            for b in range(slots):
                mask[b, sets[b][sets[b] >= 0].long()] = True
                mask[b, L[b]: L[b] + GAMMA + 1] = True  # the new tokens, rewritten by the forward anyway
            return mask

        decoder.cache.k.copy_(k_saved)
        decoder.cache.v.copy_(v_saved)
        selector.indices.copy_(pre)
        if variant == "dustin-ip":
            early = ~keep(pre)[None, :, None, :, None]
            decoder.cache.k[:1].masked_fill_(early, float("nan"))
            decoder.cache.v[:1].masked_fill_(early, float("nan"))
        late = ~keep(chosen)[:, None, :, None]
        decoder.cache.v[1].masked_fill_(late, float("nan"))
        decoder.cache.k[2].masked_fill_(late, float("nan"))
        decoder.cache.v[2].masked_fill_(late, float("nan"))
        got = decoder._verify(decoder.drafter.tokens, selector.indices)
    assert torch.equal(selector.indices, chosen)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.isnan(got).any()


def _choices_of_one_pass(decoder) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Run the decoder's next verification pass with its selector's `choose` watched: the lengths, and per call
    (layer, the set before, the set after, the layer's queries)."""
    selector, calls = decoder.selector, []
    original = selector.choose

    def spy(layer, q, k_cache, lengths):
        before = selector.indices.clone()
        original(layer, q, k_cache, lengths)
        calls.append((layer, before, selector.indices.clone(), q.clone()))

    selector.choose = spy
    with torch.inference_mode():
        L = decoder.state.lengths
        decoder._verify(decoder.drafter.tokens, selector.select(L, selector.estimate(L)))
    return L, calls


def test_a_re_selection_layer_chooses_from_its_own_queries(env) -> None:
    config = replace(dustin_config(budget=28, m=4, n_recent=8),
                     selection_layers=(LayerHeads(0, tuple(range(6))), LayerHeads(2, (1, 3))))
    decoder, _ = run("dustin-ip", env, dustin=config, max_new=8)
    L, calls = _choices_of_one_pass(decoder)
    assert [layer for layer, *_ in calls] == [0, 2]
    layer, _, final, q = calls[-1]
    for b in range(len(PROMPTS)):
        n = int(L[b])
        if n <= 28:
            continue
        scores = _true_scores(q[b].cpu(), decoder.cache.k[2][b].cpu(), n, (1, 3))
        top = sorted(range(4, n - 8), key=lambda j: -float(scores[j]))[:28 - 12]
        assert sorted(final[b].tolist()) == sorted([0, 1, 2, 3, *top, *range(n - 8, n)])


def test_a_pooled_layer_adds_its_scores_to_the_choice(env) -> None:
    """pool_layers (0) score their own verified queries as the pass goes; selection layer 2 chooses from its scores
    plus theirs (float64 reference), and the set the layers read is unchanged until layer 2."""
    config = replace(dustin_config(budget=28, m=4, n_recent=8), selection_layers=(LayerHeads(2, (1, 3)),),
                     pool_layers=(LayerHeads(0, (0, 5)),))
    decoder, _ = run("dustin-ip", env, dustin=config, max_new=8)
    L, calls = _choices_of_one_pass(decoder)
    assert [layer for layer, *_ in calls] == [0, 2]
    assert torch.equal(calls[0][1], calls[0][2])  # the pooled layer only scores
    (_, _, _, q0), (_, _, final, q2) = calls
    for b in range(len(PROMPTS)):
        n = int(L[b])
        if n <= 28:
            continue
        scores = (_true_scores(q0[b].cpu(), decoder.cache.k[0][b].cpu(), n, (0, 5))
                  + _true_scores(q2[b].cpu(), decoder.cache.k[2][b].cpu(), n, (1, 3)))
        top = sorted(range(4, n - 8), key=lambda j: -float(scores[j]))[:28 - 12]
        assert sorted(final[b].tolist()) == sorted([0, 1, 2, 3, *top, *range(n - 8, n)])


def test_pooled_page_bounds_sum_the_layers_pages(env) -> None:
    """dustin-ip-pages with pool_layers (0): selection layer 2 takes whole pages by the sum of both layers' page bounds
    over the key ranges of the whole cache (page_key_range, checked against loops above; the selector keeps its own
    ranges up to date round by round): every chosen free position scores at least every candidate left out."""
    config = replace(dustin_config(budget=44, m=0, n_recent=8), selection_layers=(LayerHeads(2, (1, 3)),),
                     pool_layers=(LayerHeads(0, (0, 5)),))
    decoder, _ = run("dustin-ip-pages", env, dustin=config, max_new=10)
    L, calls = _choices_of_one_pass(decoder)
    assert [layer for layer, *_ in calls] == [0, 2]
    (_, _, _, q0), (_, _, final, q2) = calls
    checked = 0
    for b in range(len(PROMPTS)):
        n = int(L[b])
        if n <= 44:
            continue
        pages = torch.zeros(-(-S_MAX // PAGE))
        for layer, q, heads in ((0, q0, (0, 5)), (2, q2, (1, 3))):
            low, high = page_key_range(decoder.cache.k[layer][b: b + 1].cpu(), L[b: b + 1].cpu())
            pages += page_bounds(q[b: b + 1].cpu(), low, high, L[b: b + 1].cpu(), head_weights(heads, 6, "cpu"))[0]
        score = pages.repeat_interleave(PAGE)[:S_MAX]
        chosen = set(final[b].tolist())
        free = [j for j in chosen if 4 <= j < n - 8]
        left = [j for j in range(4, n - 8) if j not in chosen]
        assert len(free) == 44 - 12 and len(chosen) == 44 and chosen >= {0, 1, 2, 3, *range(n - 8, n)}
        assert min(float(score[j]) for j in free) >= max(float(score[j]) for j in left) - 1e-5
        only_layer_2 = page_bounds(q2[b: b + 1].cpu(), *page_key_range(decoder.cache.k[2][b: b + 1].cpu(),
                                                                        L[b: b + 1].cpu()),
                                   L[b: b + 1].cpu(), head_weights((1, 3), 6, "cpu"))[0]
        assert not torch.allclose(pages, only_layer_2)  # the pooled layer changes the scores
        checked += 1
    assert checked


def test_pool_layers_are_checked() -> None:
    from trtllm_dustin.config import ConfigError

    base = dustin_config(budget=28, m=4, n_recent=8)
    for pool, selection in (((LayerHeads(1, (0,)),), (LayerHeads(1, (0,)),)),  # not below the selection layer
                            ((LayerHeads(0, (0,)),), ())):  # pooling without a selection layer
        with pytest.raises(ConfigError, match="pool_layers"):
            replace(base, selection_layers=selection, pool_layers=pool)
    with pytest.raises(ConfigError, match="pool_layers"):
        replace(base, selection_layers=(LayerHeads(2, (0,)),), pool_layers=(LayerHeads(1, (0,)), LayerHeads(0, (0,))))
    pooled = replace(base, selection_layers=(LayerHeads(2, (0,)),), pool_layers=(LayerHeads(0, (1, 2)),))
    assert DustinConfig.from_json(pooled.to_json()) == pooled
    import json

    older = json.loads(base.to_json())
    older["schema_version"] = 2
    del older["pool_layers"]
    assert DustinConfig.from_json(json.dumps(older)) == base  # a version-2 file reads as a config without pooling


def test_the_score_window_is_checked() -> None:
    from trtllm_dustin.config import ConfigError

    base = dustin_config(budget=28, m=4, n_recent=8)
    for width, op in ((4, "max"), (0, "max"), (3, "median")):
        with pytest.raises(ConfigError, match="score_window"):
            replace(base, score_window=width, score_window_op=op)
    windowed = replace(base, score_window=7, score_window_op="mean")
    assert DustinConfig.from_json(windowed.to_json()) == windowed
    import json

    older = json.loads(base.to_json())
    older["schema_version"] = 3
    del older["score_window"], older["score_window_op"]
    assert DustinConfig.from_json(json.dumps(older)) == base  # a version-3 file reads as a config without a window


# ---- decoding --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", IN_PASS)
def test_budget_over_every_length_equals_vanilla(env, vanilla_tokens, method: str) -> None:
    _, result = run(method, env, dustin=dustin_config(budget=S_MAX, m=40))
    assert result.tokens == vanilla_tokens


@pytest.mark.parametrize("method", ["dustin-ip", "dustin-ip-pages"])
def test_sparse_in_pass_really_restricts(env, vanilla_tokens, method: str) -> None:
    decoder, result = run(method, env, dustin=dustin_config(budget=28, m=4, n_recent=8))
    assert all(len(t) == 24 for t in result.tokens) and result.tokens != vanilla_tokens
    lengths = decoder.state.lengths
    with torch.inference_mode():  # the next round's set (a finished slot's last choice is from before its commit)
        sets = decoder.selector.select(lengths, decoder.selector.estimate(lengths))
    for b in range(len(PROMPTS)):
        valid = sets[b][sets[b] >= 0]
        assert len(valid) == min(28, int(lengths[b])) == len(set(valid.tolist()))
        assert bool((valid < lengths[b]).all())


def test_sparse_draft_reads_the_pass_choice(env) -> None:
    decoder, _ = run("dustin-ip-sparse-draft", env, dustin=dustin_config(budget=28, m=4, n_recent=8), max_new=10)
    assert torch.equal(decoder.drafter.view.chosen, decoder.selector.indices)


def test_the_full_feed_drafter_reads_a_full_pass_where_the_verification_is_sparse(env) -> None:
    """dustin-ip-ring-full-feed (runtime/experimental/full_feed.py), k = 28 below three of the four prompts: after a
    round, what the ring drafter was fed, and the boundary it keeps (the hidden state at the last accepted position),
    are those of a full-attention pass of the target over the round's tokens on the cache as the round found it
    (a float64 reference pass on a copy); the sparse verification's own hidden states differ from them, so a drafter
    that read those would fail this. The cache after the round holds the sparse pass's keys and values, and
    dustin-ip-ring, run beside it, keeps another boundary."""
    from trtllm_dustin.models.decoder import QueryCapture
    from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
    from trtllm_dustin.runtime.state import Progress

    config = dustin_config(budget=28, m=0, n_recent=8)
    slots = len(PROMPTS)
    setups = {}
    for method in ("dustin-ip-ring-full-feed", "dustin-ip-ring"):
        setup = MethodSetup(target=env.target, target_cache=KVCache.allocate(env.target.config, slots, S_MAX, DTYPE,
                                                                             env.device),
                            backend=get_backend(env.backend), gamma=GAMMA, dustin=config, ring=env.ring,
                            use_cuda_graph=False)
        setups[method] = build_decoder(method, setup)
    fed, plain = setups["dustin-ip-ring-full-feed"], setups["dustin-ip-ring"]
    layers = fed.drafter.target_hidden_layers
    greedy = SlotSampling.batch(SamplingParams(), slots, env.device, use_kernel=False)
    with torch.inference_mode():
        progress = {}
        for decoder in (fed, plain):
            progress[decoder] = Progress.allocate(slots, 40, GAMMA, (), env.device)
            decoder.prefill(slice(0, slots), PROMPTS, chunk=32)
            decoder.begin(progress[decoder], slice(0, slots), torch.full((slots,), 17, device=env.device), PROMPTS,
                          30)
        for _ in range(3):
            lengths, cur = fed.state.lengths.clone(), fed.state.cur.clone()
            cache = KVCache(fed.cache.k.clone(), fed.cache.v.clone(), fed.cache.seqlens.clone())
            verdict = fed.round(progress[fed], greedy)
            tokens = torch.cat([cur[:, None], fed.drafter.tokens], dim=1)  # the proposal the round verified
            want = {layer: torch.zeros(slots, GAMMA + 1, env.target.config.hidden_size, dtype=DTYPE,
                                       device=env.device) for layer in layers}
            env.target(tokens, cache, AttentionMetadata(cache_seqlens=lengths), get_backend("reference"),
                       capture=QueryCapture((), {}, want))
            rows = torch.arange(slots, device=env.device)
            for j, layer in enumerate(layers):
                torch.testing.assert_close(fed.selector.hidden[layer], want[layer])
                torch.testing.assert_close(fed.drafter.boundary[:, j], want[layer][rows, verdict.accepted])
            sparse = [b for b in range(slots) if int(lengths[b]) > config.budget]
            assert len(sparse) == 3
            assert all(not torch.allclose(fed.verify_hidden[layers[-1]][b], want[layers[-1]][b]) for b in sparse)
            # the round's keys: the full pass's (in the copy) at layer 0, which reads no attention output; from layer 1
            # on the sparse pass wrote its own over them
            for b in sparse:
                new = slice(int(lengths[b]), int(lengths[b]) + GAMMA + 1)
                torch.testing.assert_close(fed.cache.k[0, b, :, new], cache.k[0, b, :, new])
                assert not torch.allclose(fed.cache.k[1, b, :, new], cache.k[1, b, :, new])
            plain.round(progress[plain], greedy)
        # the plain method's drafter was fed the sparse states: its ring differs where the verification was sparse
        assert not torch.allclose(fed.drafter.boundary[sparse], plain.drafter.boundary[sparse])


def test_in_pass_on_the_triton_kernels(env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels (SRH scoring over every head of the verified queries, sparse verify; interpreted on the CPU)
    decode what the PyTorch references decode, k = 28 < L."""
    if env.device.type == "cpu" and torch.cuda.is_available():
        pytest.skip("on the CPU the kernels run in Triton's interpreter, chosen at import only without a GPU")
    tokens = {}
    for backend in ("reference", "triton"):
        use_interpreter(monkeypatch, not (backend == "reference" and env.device.type == "cpu"))
        decoder = _decoder("dustin-ip", replace(env, backend=backend), dustin_config(budget=28, m=4, n_recent=8),
                           slots=2)
        tokens[backend] = decoder.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=6, prefill_chunk=32)).tokens
    assert tokens["triton"] == tokens["reference"]


def test_a_config_without_selection_layers_is_refused(env) -> None:
    from trtllm_dustin.config import ConfigError

    with pytest.raises(ConfigError, match="selection_layers"):
        run("dustin-ip", env, dustin=replace(dustin_config(budget=28, m=4, n_recent=8), selection_layers=()))


# ---- the search ------------------------------------------------------------------------------------------------------
def _synthetic_trace(layers: int, peaked: int, documents: int = 2) -> tuple[AttentionTrace, torch.Tensor]:
    """Every layer's true attention is layer `peaked`'s verification attention; the other layers' own maps are that
    attention moved elsewhere plus noise. Returns the trace and the peaked maps."""
    settings = TraceSettings(window=96, steps=8, gamma=3, max_delta=2, documents=documents, sources=("x",))
    S, n = settings.window, settings.captured
    base = torch.rand(documents, n, S) ** 8
    maps = torch.stack([base if layer == peaked else base.roll(7 * (layer + 1), dims=-1) * 0.3 + torch.rand(
        documents, n, S) for layer in range(layers)])
    seqlens = _seqlens(settings)
    truth = _truth(base, settings, seqlens)[None].expand(layers, -1, -1).contiguous()
    trace = AttentionTrace(settings, tuple(f"d{i}" for i in range(documents)),
                           tuple(LayerHeads(layer, (0,)) for layer in range(layers)), (), seqlens, truth, maps, None)
    return trace, base


def _seqlens(settings: TraceSettings) -> torch.Tensor:
    """int32 [documents * steps]: each captured step's committed length."""
    return (settings.first_length + torch.arange(settings.steps)).repeat(settings.documents).to(torch.int32)


def _truth(base: torch.Tensor, settings: TraceSettings, seqlens: torch.Tensor) -> torch.Tensor:
    """[documents * steps, S]: the verification attention of maps `base` [documents, captured, S] (the Γ + 1
    queries' rows summed over the causal context), normalised per step."""
    S = settings.window
    context = torch.arange(S)[None, :] < seqlens.long()[:, None]
    window = sum(base[:, settings.max_delta + t: settings.max_delta + t + settings.steps]
                 for t in range(settings.gamma + 1)).reshape(-1, S) * context
    return window / window.sum(-1, keepdim=True)


def test_search_finds_the_layer_whose_attention_is_everyones() -> None:
    """Choosing at layer 2 covers the most mass: phase A finds it; dense layers only add."""
    torch.manual_seed(1)
    trace, _ = _synthetic_trace(4, peaked=2)
    objective = InPassObjective(SearchTraces(trace), InPassSettings(budgets=(32, 48), lag=2, max_layers=2, n_recent=8))
    outcome = search_selection_layers(objective, progress=False)
    assert outcome.layers[0] == (2, "all") and outcome.phase_a[(2, "all")] == max(outcome.phase_a.values())
    per_layer = objective.per_layer([(2, "all")], 32)
    assert all(0 < v <= 1 for v in per_layer) and per_layer[2] == max(per_layer)
    assert objective.text_arr([(2, "all")], 32, dense=2) > objective.text_arr([(2, "all")], 32)


def test_phase_b_with_earlier_adds_a_layer_below_the_first_when_the_lower_layers_attend_elsewhere() -> None:
    """Layers 0-1 attend where layer 0's queries look, layers 2-4 where layer 2's do: phase A chooses layer 2 (it
    serves three layers), phase B finds nothing above it, and with `earlier` adds layer 0, which chooses for layers
    0-1 what they attend to, where they read layer 2's set of the previous round before."""
    torch.manual_seed(4)
    settings = TraceSettings(window=96, steps=8, gamma=3, max_delta=2, documents=2, sources=("x",))
    S, n, layers = settings.window, settings.captured, 5
    low, high = torch.rand(2, n, S) ** 8, torch.rand(2, n, S) ** 8
    maps = torch.stack([low if layer == 0 else high if layer == 2 else torch.rand(2, n, S) for layer in range(layers)])
    seqlens = _seqlens(settings)
    truths = torch.stack([_truth(low if layer < 2 else high, settings, seqlens) for layer in range(layers)])
    trace = AttentionTrace(settings, ("d0", "d1"), tuple(LayerHeads(layer, (0,)) for layer in range(layers)), (),
                           seqlens, truths, maps, None)
    outcomes = {earlier: search_selection_layers(InPassObjective(SearchTraces(trace), InPassSettings(
        budgets=(32,), lag=2, max_layers=2, max_pool=0, n_recent=8, earlier=earlier)), progress=False)
        for earlier in (False, True)}
    assert outcomes[False].layers == ((2, "all"),)
    assert set(outcomes[False].phase_b[0]) == {(3, "all"), (4, "all")}  # later layers only
    assert outcomes[True].layers == ((0, "all"), (2, "all")) and outcomes[True].value > outcomes[False].value
    objective = InPassObjective(SearchTraces(trace), InPassSettings(budgets=(32,), lag=2, n_recent=8))
    with_low, without = objective.per_layer([(0, "all"), (2, "all")], 32), objective.per_layer([(2, "all")], 32)
    assert with_low[0] > without[0] and with_low[1] > without[1] and with_low[2:] == without[2:]


def test_needle_recall_counts_the_needle_tokens_in_every_layers_set() -> None:
    """Needles at known spans: recall is the share of span tokens in each layer's set (against a direct count), and
    a candidate whose scores peak on the needle recalls all of it."""
    torch.manual_seed(2)
    text, _ = _synthetic_trace(3, peaked=0)
    needle, base = _synthetic_trace(3, peaked=1, documents=2)
    spans = torch.tensor([[10, 14], [30, 33]])
    for d, (a, b) in enumerate(spans.tolist()):  # layer 1's maps put their mass on the needle
        needle.target_maps[1, d] = 0.0
        needle.target_maps[1, d, :, a:b] = 1.0
    objective = InPassObjective(SearchTraces(text), InPassSettings(budgets=(32,), lag=2, n_recent=8),
                                SearchTraces(needle, needle_spans=spans))
    assert objective.needle_recall([(1, "all")], 32) == 1.0
    got = objective.needle_recall([(2, "all")], 32)
    reads = objective._reads(objective.needles, [(2, "all")], 32)
    rows = spans.repeat_interleave(needle.settings.steps, dim=0)
    direct = sum(len(set(sets[r].tolist()) & set(range(a, b))) / (b - a)
                 for sets in reads for r, (a, b) in enumerate(rows.tolist())) / (len(reads) * len(rows))
    assert got == pytest.approx(direct) and got < 1.0


def test_phase_c_pools_the_layer_that_holds_the_rest_of_the_truth() -> None:
    """The truth is the sum of layer 1's and layer 0's verification attention (layer 1 the larger part): phase A
    chooses layer 1, phase C pools layer 0 (the sum is the truth), and nothing else gains."""
    torch.manual_seed(3)
    trace, base = _synthetic_trace(4, peaked=1)
    s = trace.settings
    other = torch.rand_like(base) ** 8
    trace.target_maps[0] = other
    for layer in (2, 3):
        trace.target_maps[layer] = torch.rand_like(base)
    context = torch.arange(s.window)[None, :] < trace.seqlens.long()[:, None]

    def window(maps: torch.Tensor) -> torch.Tensor:
        return sum(maps[:, s.max_delta + t: s.max_delta + t + s.steps] for t in range(s.gamma + 1)).reshape(
            -1, s.window) * context

    truth = 0.6 * window(base) / window(base).sum(-1, keepdim=True) + 0.4 * window(other) / window(other).sum(
        -1, keepdim=True)
    trace.truth_by_layer.copy_(truth[None].expand_as(trace.truth_by_layer))
    objective = InPassObjective(SearchTraces(trace), InPassSettings(budgets=(24, 32), lag=2, max_layers=1,
                                                                    n_recent=8))
    outcome = search_selection_layers(objective, progress=False)
    assert outcome.layers == ((1, "all"),) and outcome.pool == ((0, "all"),)
    assert outcome.value == pytest.approx(objective.mean([(1, "all")], [(0, "all")]))
    assert outcome.value > outcome.phase_a[(1, "all")] + 0.002
    assert outcome.to_dict()["pool"] == [{"layer": 0, "heads": "all"}]


def test_phase_d_keeps_a_score_window_where_the_truth_spreads_to_the_neighbours() -> None:
    """Every layer attends to the chooser's peaks and their two neighbours on each side, while the chooser's own scores
    sit on the peaks alone: phase D keeps a window (its set then covers the neighbours), and where the truth is the
    chooser's own attention it keeps none."""
    torch.manual_seed(5)
    trace, base = _synthetic_trace(3, peaked=1)
    s = trace.settings
    spread = torch.nn.functional.max_pool1d(base.reshape(-1, 1, s.window), 5, stride=1, padding=2).view_as(base)
    windows = ((3, "max"), (5, "max"), (5, "mean"))
    plain = search_selection_layers(InPassObjective(SearchTraces(trace), InPassSettings(
        budgets=(48,), lag=2, max_layers=1, max_pool=0, n_recent=8, windows=windows)), progress=False)
    assert plain.layers == ((1, "all"),) and plain.window == (1, "max")
    assert dict(plain.phase_d)[(1, "max")] == plain.value == plain.phase_a[(1, "all")]
    trace.truth_by_layer.copy_(_truth(spread, s, trace.seqlens)[None].expand_as(trace.truth_by_layer))
    objective = InPassObjective(SearchTraces(trace), InPassSettings(budgets=(48,), lag=2, max_layers=1, max_pool=0,
                                                                    n_recent=8, windows=windows))
    outcome = search_selection_layers(objective, progress=False)
    assert outcome.window in windows and outcome.value == max(dict(outcome.phase_d).values())
    assert outcome.value == pytest.approx(objective.mean([(1, "all")], window=outcome.window))
    assert outcome.value > dict(outcome.phase_d)[(1, "max")] + 0.002
    assert outcome.to_dict()["window"] == {"width": outcome.window[0], "op": outcome.window[1]}


def test_score_windows_are_read_and_checked() -> None:
    """`--score-windows 21max 9mean` reads as (width, op); an even or too narrow width, an unknown op or a missing width
    is refused with the value named."""
    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.search.cli import _score_window

    assert [_score_window(t) for t in ("21max", "9mean")] == [(21, "max"), (9, "mean")]
    assert InPassSettings(windows=((21, "max"), (9, "mean"))).windows == ((21, "max"), (9, "mean"))
    with pytest.raises(ConfigError, match="'max'"):
        _score_window("max")
    for window in ((4, "max"), (1, "max"), (5, "median")):
        with pytest.raises(ConfigError, match=f"score window {window[0]}{window[1]}"):
            InPassSettings(windows=(window,))
