"""The one round, every method (Classic SD, MagicDec, Dustin, sparse drafting) against vanilla decoding and against its
own invariants: greedy equality, what each phase reads, the stop rules, seeding, padded vocabularies."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import speculative
from helpers.kernels import use_interpreter
from helpers.speculative import DTYPE, GAMMA, PROMPTS, S_MAX, Env, dustin_config, run
from torch.overrides import TorchFunctionMode

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime import phases
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.experimental import OracleSelector
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import METHODS, MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams

# The plugins' references on the CPU (test_dustin_end_to_end_on_the_triton_kernels runs the kernels, interpreted).
pytestmark = pytest.mark.usefixtures("plugin_references")
env, vanilla_tokens = speculative.env, speculative.vanilla_tokens  # the shared module-scoped fixtures


@pytest.mark.parametrize("method", ["classic", "magicdec"])
def test_full_verification_methods_equal_vanilla_greedy(env: Env, vanilla_tokens, method: str) -> None:
    _, result = run(method, env)
    assert result.tokens == vanilla_tokens
    assert 1 <= result.tau <= GAMMA + 1 and sum(result.committed_hist) > 0


@pytest.mark.parametrize("variant", ["dustin-h", "dustin-t", "dustin-d"])
def test_dustin_with_budget_over_every_length_equals_vanilla(env: Env, vanilla_tokens, variant: str) -> None:
    _, result = run(variant, env, dustin=dustin_config(budget=S_MAX, m=40))
    assert result.tokens == vanilla_tokens


@pytest.mark.parametrize("method", ["classic", "dustin-h"])
def test_draft_equal_to_target_accepts_everything(env: Env, vanilla_tokens, method: str) -> None:
    config = DustinConfig(target_layers=(LayerHeads(1, (0,)),), draft_layers=(LayerHeads(2, (5,)),), budget=S_MAX,
                          m=40, gamma=GAMMA)
    _, result = run(method, env, draft=env.target, dustin=config)
    assert result.tokens == vanilla_tokens
    assert result.committed_hist[:GAMMA] == [0] * GAMMA and result.tau == GAMMA + 1


def test_sparse_dustin_runs_and_really_restricts(env: Env, vanilla_tokens) -> None:
    decoder, result = run("dustin-h", env, dustin=dustin_config(budget=28, m=4, n_recent=8))
    assert all(len(t) == 24 for t in result.tokens) and 1 <= result.tau <= GAMMA + 1
    lens = decoder.state.lengths
    with torch.inference_mode():  # the set a next round would verify against (the run stops at its last commit)
        indices = decoder.selector.select(lens, decoder.selector.estimate(lens))
    for b in range(len(PROMPTS)):
        valid = indices[b][indices[b] >= 0]
        assert len(valid) == min(28, int(lens[b])) and bool((valid < lens[b]).all())
    assert result.tokens != vanilla_tokens  # 28 of up to 94 positions: the tiny random model notices


def test_sparse_verification_reads_only_the_selected_positions(env: Env) -> None:
    decoder, _ = run("dustin-h", env, dustin=dustin_config(budget=28, m=4, n_recent=8), max_new=10)
    with torch.inference_mode():
        L = decoder.state.lengths
        indices = decoder.selector.select(L, decoder.selector.estimate(L))
        expected = decoder._verify(decoder.drafter.tokens, indices).clone()
        keep = torch.zeros(decoder.cache.batch_slots, S_MAX, dtype=torch.bool, device=env.device)
        for b in range(keep.shape[0]):
            keep[b, indices[b][indices[b] >= 0].long()] = True
            keep[b, L[b]: L[b] + GAMMA + 1] = True  # the new tokens, rewritten by the forward anyway
        poison = ~keep[None, :, None, :, None]  # [layers, B, H, S, D]
        decoder.cache.k.masked_fill_(poison, float("nan"))
        decoder.cache.v.masked_fill_(poison, float("nan"))
        got = decoder._verify(decoder.drafter.tokens, indices)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_magicdec_draft_attends_only_to_sinks_and_window(env: Env) -> None:
    decoder, _ = run("magicdec", env, max_new=10)
    drafter = decoder.drafter
    with torch.inference_mode():
        expected = drafter._forward(decoder.state, 1).clone()
        lens = decoder.state.lengths + 1  # step 1's new token sits at L + 1
        keep = torch.zeros(drafter.cache.batch_slots, S_MAX, dtype=torch.bool, device=env.device)
        for b in range(keep.shape[0]):
            n = int(lens[b])
            keep[b, : min(4, n)] = True
            keep[b, max(0, n - 8): n + 1] = True  # budget 12 = 4 sinks + 8 recent, plus the new token
        poison = ~keep[None, :, None, :, None]
        drafter.cache.k.masked_fill_(poison, float("nan"))
        drafter.cache.v.masked_fill_(poison, float("nan"))
        got = drafter._forward(decoder.state, 1)
        full = drafter.model(drafter.tokens[:, :1], drafter.cache, AttentionMetadata(lens), decoder.backend,
                             logit_index=torch.zeros_like(lens, dtype=torch.long))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.isnan(full).any()  # a full-cache draft step would have read the poisoned positions


def test_eos_in_the_middle_of_a_batch_stops_only_that_sequence(env: Env, vanilla_tokens) -> None:
    eos = vanilla_tokens[1][5]
    _, result = run("classic", env, eos_token_ids=(eos,))
    for got, full in zip(result.tokens, vanilla_tokens, strict=True):
        assert got == (full[: full.index(eos) + 1] if eos in full else full)


def test_sequences_never_outgrow_the_cache(env: Env) -> None:
    with pytest.raises(ValueError, match=r"--max-seq-len 160 is smaller than prompt 0 \(70 tokens\)"):
        run("classic", env, max_new=S_MAX - 70)
    _, result = run("classic", env, max_new=S_MAX - 70 - GAMMA)  # exactly fits
    assert all(len(t) == S_MAX - 70 - GAMMA for t in result.tokens[:1])


def test_sampled_speculative_decoding_is_seeded(env: Env) -> None:
    sampling = SamplingParams(1.0, 0.9, seed=3)
    config = dustin_config(budget=28, m=4, n_recent=8)
    a = run("dustin-h", env, dustin=config, sampling=sampling)[1].tokens
    b = run("dustin-h", env, dustin=config, sampling=sampling)[1].tokens
    assert a == b and all(len(t) == 24 for t in a)


def test_dustin_without_a_config_says_how_to_get_one(env: Env) -> None:
    with pytest.raises(ConfigError, match="trtllm-dustin search"):
        run("dustin-h", env)


def test_sparse_draft_with_budget_over_every_length_equals_vanilla(env: Env, vanilla_tokens) -> None:
    _, result = run("dustin-h-sparse-draft", env, dustin=dustin_config(budget=S_MAX, m=40))
    assert result.tokens == vanilla_tokens


def test_sparse_draft_reads_only_the_verification_set_and_recent_positions(env: Env) -> None:
    decoder, _ = run("dustin-h-sparse-draft", env, dustin=dustin_config(budget=28, m=4, n_recent=8), max_new=10)
    drafter, view = decoder.drafter, decoder.drafter.view
    assert torch.equal(view.chosen, decoder.selector.indices)  # what the last round verified against
    with torch.inference_mode():
        expected = drafter._forward(decoder.state, 1).clone()
        L = decoder.state.lengths.long()
        keep = torch.zeros(drafter.cache.batch_slots, S_MAX, dtype=torch.bool, device=env.device)
        for b in range(keep.shape[0]):
            keep[b, view.chosen[b][view.chosen[b] >= 0].long()] = True
            keep[b, view.selected_at[b]: L[b] + 2] = True  # committed since the selection, and step 1's token
        poison = ~keep[None, :, None, :, None]
        drafter.cache.k.masked_fill_(poison, float("nan"))
        drafter.cache.v.masked_fill_(poison, float("nan"))
        got = drafter._forward(decoder.state, 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_draft_with_a_smaller_padded_vocabulary(env: Env) -> None:
    """Qwen2.5-0.5B pads to 151936 ids, 7B to 152064: the target then proposes only the shared ids."""
    from trtllm_dustin.models.loading import _empty_model, _random_init

    small = _empty_model(env.draft.config.with_(vocab_size=250, name="small-vocab"), env.device, DTYPE, None)
    _random_init(small, seed=5)
    for sampling in (SamplingParams(), SamplingParams(1.0, 1.0, seed=2)):
        _, result = run("classic", env, draft=small, sampling=sampling)
        assert all(len(t) == 24 and max(t) < 250 for t in result.tokens)


SPARSE = [name for name, method in METHODS.items() if method.sparse]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_with_budget_over_every_length_equals_vanilla(env: Env, vanilla_tokens, method: str) -> None:
    """k = max_seq_len: every verification set holds the whole context, so each registered method is lossless."""
    _, result = run(method, env, dustin=dustin_config(budget=S_MAX, m=40))
    assert result.tokens == vanilla_tokens


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", SPARSE)
def test_a_selector_runs_an_estimate_phase_exactly_when_its_estimate_does_something(env: Env, method: str) -> None:
    """`estimates()` is False exactly for the selectors whose estimate calls no torch function and returns None
    (StreamingLLM's sinks and window, SnapKV's prompt-time set, in-pass selection without the lookahead's share or page
    bounds), and the round then runs no estimate phase: on the GPU no captured phase of the run is an empty CUDA graph
    (torch warns of one at capture; the round would replay it every round)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder, _ = run(method, env, dustin=dustin_config(budget=72, m=12, n_recent=8))  # SnapKV needs k > 32
    empty = [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    assert not empty, f"{method}: {len(empty)} captured phase(s) with nothing in them"
    selector, lengths = decoder.selector, decoder.state.lengths
    with torch.inference_mode(), _TorchCalls() as counted:
        scores = selector.estimate(lengths)
    assert selector.estimates() == (counted.calls > 0 or scores is not None), counted.calls
    if not selector.estimates():
        selector.estimate = lambda lengths: pytest.fail("the round ran the estimate of a selector that skips it")
        with torch.inference_mode():
            assert phases.choose(selector, lengths) is not None


@pytest.mark.parametrize("method", SPARSE)
def test_selection_with_lengths_on_both_sides_of_the_budget(env: Env, vanilla_tokens, method: str) -> None:
    """L < k < max_seq_len (no short-circuit in the selection): slots that never outgrow k = 72 verify against their
    whole context and equal vanilla; the slots past k verify against exactly k distinct committed positions."""
    budget = 72
    decoder, result = run(method, env, dustin=dustin_config(budget=budget, m=12, n_recent=8))
    for b in (1, 2):  # prompts of 3 and 41 tokens + 24 new: at most 65 <= k
        assert result.tokens[b] == vanilla_tokens[b], f"slot {b}"
    lengths = decoder.state.lengths
    scores = decoder.selector.estimate(lengths)
    indices = decoder.selector.select(lengths, scores)
    if indices is None:  # dustin-h-periodic's coming round verifies in full: the set of the rounds between
        indices = decoder.selector.inner.select(lengths, scores)
    if isinstance(decoder.selector, OracleSelector) and decoder.selector.per_layer:  # a set per layer
        indices = decoder.selector.layer_sets()[:, :, None]  # [L, B, 1, k]
    elif indices.dim() == 2:  # one set per slot; evaluation selectors may return one per KV head
        indices = indices[None, :, None]  # [1, B, 1, k]
    else:
        indices = indices[None]  # [1, B, H_kv, k]
    for sets in indices:
        for b in range(len(PROMPTS)):
            for row in sets[b]:
                valid = row[row >= 0]
                L = int(lengths[b])
                assert len(valid) == min(budget, L) and len(set(valid.tolist())) == len(valid)
                assert bool((valid < L).all())
                if decoder.selector.in_pass is None:  # in-pass sets keep a fixed slot layout instead (in_pass.py)
                    assert valid.tolist() == sorted(valid.tolist())
    assert int(lengths[0]) > budget and int(lengths[3]) > budget  # the selection really chose for these two


def test_dustin_end_to_end_on_the_triton_kernels(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend and every kernel of a round (sparse-verify, verify, SRH, argmax, commit; on the CPU under
    TRITON_INTERPRET=1) decode what the PyTorch references decode, with sparse verification (k = 28 < L) and sparse
    drafting: two prompts of 70 and 3 tokens, 6 new tokens."""
    if env.device.type == "cpu" and torch.cuda.is_available():
        pytest.skip("on the CPU the kernels run in Triton's interpreter, chosen at import only without a GPU")
    config = dustin_config(budget=28, m=4, n_recent=8)
    prompts = PROMPTS[:2]
    tokens = {}
    for backend in ("reference", "triton"):
        use_interpreter(monkeypatch, not (backend == "reference" and env.device.type == "cpu"))  # the references too
        setup = MethodSetup(target=env.target, target_cache=KVCache.allocate(env.target.config, 2, S_MAX, DTYPE,
                                                                             env.device),
                            backend=get_backend(backend), draft=env.draft,
                            draft_cache=KVCache.allocate(env.draft.config, 2, S_MAX, DTYPE, env.device), gamma=GAMMA,
                            dustin=config)
        decoder = build_decoder("dustin-h-sparse-draft", setup)
        tokens[backend] = decoder.generate(prompts, GenerationConfig(max_new_tokens=6, prefill_chunk=32)).tokens
    assert tokens["triton"] == tokens["reference"]
