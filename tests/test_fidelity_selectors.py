"""The fidelity experiments' selectors (issue 24) against independent references.

- attention_mass against a float64 loop over sequences, heads, queries and positions; top_k_set against sorted();
- sparse verification with a set per KV head (the Triton kernel under the interpreter, the plugin reference and the
  reference backend) against the one-set reference run head group by head group, with unread rows poisoned;
- a set per layer: each layer reads only its own rows (the others poisoned), and equal sets equal the shared path;
- the oracle's set is the top k of the true attention of an independent full pass (it covers the most attention mass
  k positions can); the per-layer oracle's sets are each layer's top k;
- Dustin-H's accumulated history is decay x the old sum + the committed tokens' SRH attention (srh_score_ref);
  its per-KV-head sets are Eq. 6 with each group's own SRH heads (all of them where a group has none);
- periodic full verification: every round in full equals vanilla; every third round has no set.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import speculative
from helpers.kernels import use_interpreter
from helpers.speculative import DTYPE, GAMMA, S_MAX, Env, dustin_config, run

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.dustin_config import LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture
from trtllm_dustin.plugins import sparse_verify_attention
from trtllm_dustin.plugins.reference import sparse_verify_attention_ref, srh_score_ref
from trtllm_dustin.plugins.selection import select_verify_indices
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView
from trtllm_dustin.runtime.experimental import LayerSets, PeriodicFullVerification, attention_mass, top_k_set
from trtllm_dustin.runtime.selectors import DustinSelector
from trtllm_dustin.runtime.state import Observation

pytestmark = pytest.mark.usefixtures("plugin_references")
env, vanilla_tokens = speculative.env, speculative.vanilla_tokens  # its module-scoped fixtures


# ---- attention mass and top-k ----------------------------------------------------------------------------------------
def mass_loop(q, k, lengths, per_kv_head):
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.zeros(B, Hkv, S, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for t in range(T):
                logits = [float(q[b, t, h].double() @ k[b, g, j].double()) / math.sqrt(D) for j in range(L + t + 1)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                for j in range(L):
                    out[b, g, j] += weights[j] / sum(weights)
    return out if per_kv_head else out.sum(1)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_attention_mass_matches_a_loop(per_kv_head: bool) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(3, 4, 6, 16), torch.randn(3, 2, 40, 16)  # srh_score takes head dims of 16 and up
    lengths = torch.tensor([30, 5, 36], dtype=torch.int32)
    got = attention_mass(q, k, lengths, per_kv_head)
    assert torch.allclose(got.double(), mass_loop(q, k, lengths, per_kv_head), atol=1e-5)


def test_top_k_set_is_the_sorted_top_k_or_everything() -> None:
    torch.manual_seed(1)
    scores = torch.rand(3, 2, 50)  # [B, H_kv, S]
    lengths = torch.tensor([40, 7, 12], dtype=torch.int32)
    got = top_k_set(scores, lengths, 10)
    for b, L in enumerate(lengths.tolist()):
        for g in range(2):
            want = list(range(L)) + [-1] * (10 - L) if L <= 10 else \
                sorted(sorted(range(L), key=lambda j: -float(scores[b, g, j]))[:10])
            assert got[b, g].tolist() == want
    layered = top_k_set(scores.permute(1, 0, 2), lengths, 10, batch_axis=1)  # [L=2, B, S]
    assert torch.equal(layered, got.permute(1, 0, 2))


# ---- a set per KV head, a set per layer ----------------------------------------------------------------------------
def per_head_problem(seed: int = 2):
    torch.manual_seed(seed)
    B, T, Hkv, G, D, S = 3, 4, 2, 3, 16, 90
    lengths = torch.tensor([80, 9, 50], dtype=torch.int32)
    q = torch.randn(B, T, Hkv * G, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    sets = torch.full((B, Hkv, 12), -1, dtype=torch.int32)
    for b, L in enumerate(lengths.tolist()):
        for g in range(Hkv):
            chosen = torch.randperm(L)[:min(12, L)].sort().values
            sets[b, g, :len(chosen)] = chosen.to(torch.int32)
    return q, k, v, lengths, sets, G


def poisoned(cache: torch.Tensor, sets: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """NaN in every row a KV head's set does not hold (the T new rows stay readable)."""
    read = torch.zeros(cache.shape[:3], dtype=torch.bool, device=cache.device)
    for b, L in enumerate(lengths.tolist()):
        for g in range(cache.shape[1]):
            read[b, g, [j for j in sets[b, g].tolist() if j >= 0]] = True
            read[b, g, L:L + T] = True
    return cache.masked_fill(~read[..., None], float("nan"))


def one_set_per_group(q, k, v, lengths, sets, G):
    return torch.cat([sparse_verify_attention_ref(q[:, :, g * G:(g + 1) * G].double(), k[:, g:g + 1].double(),
                                                  v[:, g:g + 1].double(), lengths, sets[:, g])
                      for g in range(k.shape[1])], dim=2)


@pytest.mark.parametrize("path", ["kernel", "plugin reference", "reference backend", "kernel on cuda"])
def test_a_set_per_kv_head_reads_only_its_rows(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, lengths, sets, G = per_head_problem()
    want = one_set_per_group(q, k, v, lengths, sets, G)
    kp, vp = poisoned(k, sets, lengths, q.shape[1]), poisoned(v, sets, lengths, q.shape[1])
    if path == "kernel on cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        got = sparse_verify_attention(*(x.cuda() for x in (q, kp, vp, lengths, sets))).cpu()
    elif path == "kernel":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("Triton's interpreter is chosen at import, only on a machine without a GPU")
        use_interpreter(monkeypatch, True)
        got = sparse_verify_attention(q, kp, vp, lengths, sets)
    elif path == "plugin reference":  # it masks the whole cache (0 x NaN is NaN): clean rows
        got = sparse_verify_attention(q, k, v, lengths, sets)
    else:
        got = get_backend("reference").attend(q, kp, vp, AttentionMetadata(cache_seqlens=lengths, indices=sets))
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, atol=1e-4)


def test_a_set_per_layer_reads_only_that_layers_rows(env: Env) -> None:
    target = env.target
    config = target.config
    lengths = torch.tensor([70, 3, 41, 55], dtype=torch.int32, device=env.device)
    torch.manual_seed(3)
    cache = KVCache.allocate(config, 4, S_MAX, DTYPE, env.device)
    cache.k.normal_()
    cache.v.normal_()
    sets = torch.stack([top_k_set(torch.rand(4, S_MAX, device=env.device), lengths, 20)
                        for _ in range(config.num_layers)])  # [L, B, k]
    tokens = torch.randint(0, config.vocab_size, (4, GAMMA + 1), device=env.device)
    backend = get_backend(env.backend)
    def layered(sets: torch.Tensor) -> AttentionMetadata:  # each layer's set reaches it through the in-pass seam
        shared = sets[0].clone()
        return AttentionMetadata(cache_seqlens=lengths, indices=shared, in_pass=LayerSets(sets, shared))

    clean = target(tokens, KVCache(cache.k.clone(), cache.v.clone(), cache.seqlens), layered(sets), backend)
    dirty = KVCache(cache.k.clone(), cache.v.clone(), cache.seqlens)
    for layer in range(config.num_layers):
        dirty.k[layer].copy_(poisoned(cache.k[layer], sets[layer][:, None].expand(-1, config.num_kv_heads, -1),
                                      lengths, 0))
        dirty.v[layer].copy_(poisoned(cache.v[layer], sets[layer][:, None].expand(-1, config.num_kv_heads, -1),
                                      lengths, 0))
    got = target(tokens, dirty, layered(sets), backend)  # the forward writes the new rows itself
    assert torch.isfinite(got).all() and torch.allclose(got, clean, atol=1e-5)
    same = layered(sets[:1].expand_as(sets))
    shared = AttentionMetadata(cache_seqlens=lengths, indices=sets[0])
    fresh = KVCache(cache.k.clone(), cache.v.clone(), cache.seqlens)
    assert torch.equal(target(tokens, fresh, same, backend), target(tokens, fresh, shared, backend))
    assert not torch.allclose(target(tokens, fresh, shared, backend), clean, atol=1e-3)  # the layers' sets matter


# ---- the oracle ------------------------------------------------------------------------------------------------------
def oracle_and_truth(env: Env, method: str, budget: int = 24):
    """A decoder of `method` after a run, its next set, and the true attention of an independent full pass."""
    decoder, _ = run(method, env, dustin=dustin_config(budget=budget, m=2, n_recent=4), max_new=8)
    lengths = decoder.state.lengths.clone()
    sets = decoder.selector.select(lengths, decoder.selector.estimate(lengths))
    config = env.target.config
    tokens = torch.cat([decoder.state.cur[:, None], decoder.drafter.tokens], dim=1)
    cache = KVCache(decoder.cache.k.clone(), decoder.cache.v.clone(), lengths)
    queries = {layer: torch.zeros(4, GAMMA + 1, config.num_heads, config.head_dim, dtype=DTYPE, device=env.device)
               for layer in range(config.num_layers)}
    env.target(tokens, cache, AttentionMetadata(cache_seqlens=lengths), get_backend("reference"),
               capture=QueryCapture(tuple(queries), queries))
    masses = torch.stack([mass_loop(queries[layer].cpu(), cache.k[layer].cpu(), lengths.cpu(), False)
                          for layer in range(config.num_layers)])  # [L, B, S]
    return decoder, lengths.cpu(), sets.cpu(), masses


def covered(mass: torch.Tensor, row: torch.Tensor) -> float:
    return float(mass[[j for j in row.tolist() if j >= 0]].sum())


def test_the_oracle_takes_the_top_k_of_the_true_attention(env: Env) -> None:
    _, lengths, sets, masses = oracle_and_truth(env, "oracle")
    total = masses.sum(0)
    assert int(lengths.max()) > 24  # the oracle really chose
    for b, L in enumerate(lengths.tolist()):
        chosen = [j for j in sets[b].tolist() if j >= 0]
        assert len(chosen) == min(24, L)
        best = sorted(range(L), key=lambda j: -float(total[b, j]))[:24]
        assert covered(total[b], sets[b]) == pytest.approx(sum(float(total[b, j]) for j in best), rel=1e-5)


def test_the_per_layer_oracle_takes_each_layers_top_k(env: Env) -> None:
    decoder, lengths, _, masses = oracle_and_truth(env, "oracle-layer")
    sets = decoder.selector.layer_sets().cpu()  # [L, B, k]; `select` returned layer 0's, the one the pass reads first
    assert sets.shape[0] == env.target.config.num_layers
    for layer in range(sets.shape[0]):
        for b, L in enumerate(lengths.tolist()):
            best = sorted(range(L), key=lambda j: -float(masses[layer, b, j]))[:24]
            assert covered(masses[layer, b], sets[layer, b]) == pytest.approx(
                sum(float(masses[layer, b, j]) for j in best), rel=1e-5)


# ---- Dustin-H: accumulated history, a set per KV head ----------------------------------------------------------------
def dustin_selector(env: Env, heads=(0, 4), **options):
    config = env.target.config
    cfg = replace(dustin_config(budget=20, m=6, n_recent=4), target_layers=(LayerHeads(1, heads),))
    cache = KVCache.allocate(config, 3, 60, DTYPE, env.device)
    torch.manual_seed(4)
    cache.k.normal_()
    lookahead = Lookahead({layer.layer: torch.randn(3, GAMMA, 4, 16, device=env.device) for layer in cfg.draft_layers},
                          {layer.layer: torch.randn(3, 2, 60, 16, device=env.device) for layer in cfg.draft_layers})
    return DustinSelector(cfg, cache, config, DTYPE, lookahead, **options), cache, cfg


def test_accumulated_history_is_the_decayed_sum_of_committed_attention(env: Env) -> None:
    decay = 0.5
    selector, cache, cfg = dustin_selector(env, history_decay=decay)
    config, layer, heads = env.target.config, 1, cfg.target_layers[0].heads
    lengths = torch.tensor([40, 30, 25], dtype=torch.int32, device=env.device)
    prompt_q = torch.randn(3, config.num_heads, config.head_dim, device=env.device)
    selector.on_prefill(PrefillView(slice(0, 3), [[1] * 40, [1] * 30, [1] * 25], lengths, {layer: prompt_q}, {}))
    start = srh_score_ref(prompt_q[:, None], cache.k[layer], lengths - 1, heads)
    assert torch.allclose(selector.s_history, start, atol=1e-5)
    verify_q = torch.randn(3, GAMMA + 1, config.num_heads, config.head_dim, device=env.device)
    accepted = torch.tensor([0, 3, 1], device=env.device)
    active = torch.tensor([True, True, False], device=env.device)
    selector.observe(Observation(accepted, accepted, active, lengths, None, {layer: verify_q}))
    for b in range(3):
        want = start[b].clone()
        if active[b]:
            want = decay * want + sum(srh_score_ref(verify_q[b:b + 1, t:t + 1], cache.k[layer][b:b + 1],
                                                    lengths[b:b + 1] + t, heads)[0]
                                      for t in range(int(accepted[b]) + 1))
        assert torch.allclose(selector.s_history[b], want, atol=1e-5), f"slot {b}"
    s_draft, s_target = selector.estimate(lengths)
    assert torch.equal(s_target, selector.s_history)  # the running sum is what selection reads


@pytest.mark.parametrize("heads", [(0, 4), (0, 1)])
def test_a_set_per_kv_head_is_eq6_with_each_groups_heads(env: Env, heads) -> None:
    selector, cache, cfg = dustin_selector(env, heads=heads, per_kv_head=True)
    config = env.target.config
    lengths = torch.tensor([50, 12, 33], dtype=torch.int32, device=env.device)
    history = torch.randn(3, 1, config.num_heads, config.head_dim, device=env.device)
    selector.history_q[1].copy_(history)
    s_draft, s_target = selector.estimate(lengths)
    sets = selector.select(lengths, (s_draft, s_target))
    assert sets.shape == (3, config.num_kv_heads, 20)
    group = config.num_heads // config.num_kv_heads
    for g in range(config.num_kv_heads):
        own = tuple(h for h in heads if h // group == g) or heads  # a group without SRH heads takes them all
        s_g = srh_score_ref(history, cache.k[1], lengths - 1, own)
        want = select_verify_indices(s_draft, s_g, lengths, 20, cfg.m, cfg.n_sink, cfg.n_recent)
        assert torch.equal(sets[:, g], want), f"KV head {g}"


# ---- periodic full verification -------------------------------------------------------------------------------------
def test_every_round_in_full_equals_vanilla(env: Env, vanilla_tokens, monkeypatch: pytest.MonkeyPatch) -> None:
    import trtllm_dustin.runtime.experimental.methods as experimental
    import trtllm_dustin.runtime.methods as methods

    spec = methods.METHODS["dustin-h-periodic"]
    monkeypatch.setitem(methods.METHODS, "dustin-h-periodic", replace(spec, selector=experimental._periodic(1)))
    _, result = run("dustin-h-periodic", env, dustin=dustin_config(budget=24, m=6, n_recent=4))
    assert result.tokens == vanilla_tokens


def test_every_third_round_verifies_in_full(env: Env) -> None:
    decoder, _ = run("dustin-h", env, dustin=dustin_config(budget=24, m=6, n_recent=4), max_new=2)
    periodic = PeriodicFullVerification(decoder.selector, 3)
    lengths = decoder.state.lengths
    seen = []
    for _ in range(7):
        sets = periodic.select(lengths, periodic.estimate(lengths))
        seen.append(sets is None)
        none = torch.zeros(4, dtype=torch.long, device=lengths.device)
        periodic.observe(Observation(none, none, torch.zeros(4, dtype=torch.bool, device=lengths.device), lengths, sets,
                                     {1: torch.zeros(4, GAMMA + 1, 6, 16, device=lengths.device)}))
    assert seen == [False, False, True, False, False, True, False]
