"""Prefix caching and the prefill token budget of the in-flight batcher (runtime/prefix_cache.py, runtime/inflight.py):
prompts that share a document reuse its K/V and still get exactly a cold run's tokens, for every offered method; the
cache stays within its memory limit, evicting leaves before roots; a request cancelled while it prefills leaves
nothing behind; a larger prefill budget admits queued prompts in fewer steps without stalling the running ones."""

from __future__ import annotations

import pytest
import torch
from helpers.serving import (
    EOS,
    SERVED,
    direct_text,
    make_batcher,
    prompt_text,
    reference_kernels,
    run_requests,
    serve_requests,
)

from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.inflight import SlotRequest
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS
from trtllm_dustin.runtime.prefix_cache import PrefixCache
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine

BLOCK = 8
DOCUMENT = prompt_text(50, 40)  # 5 blocks, shared by every request below


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _document_requests(n: int = 4) -> list[SlotRequest]:
    """The document, then a distinct question of 6-15 tokens; every other request sampled (seeded)."""
    return [SlotRequest(_ids(DOCUMENT + prompt_text(60 + i, 6 + 3 * i)), 12 + i,
                        SamplingParams(0.9, 0.85, seed=10 + i) if i % 2 else SamplingParams(0.0)) for i in range(n)]


def _cold(method: str, request: SlotRequest) -> list[int]:
    s = request.sampling
    text = direct_text(method, "".join(map(chr, request.prompt)), request.max_new_tokens, s.temperature, s.top_p,
                       s.seed)
    return _ids(text)


def _single_slot_caches(seed: int, layers: int = 2, heads: int = 2, length: int = 64, dim: int = 4) -> list[KVCache]:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, 1, heads, length, dim)
    return [KVCache(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.zeros(1, dtype=torch.int32))
            for _ in range(2)]  # a target's and a draft's


def test_keys_are_a_chain_over_whole_blocks_and_match_leaves_the_last_token() -> None:
    cache = PrefixCache(1 << 20, block=4)
    a, b = list(range(10, 23)), list(range(10, 18)) + [99] + list(range(19, 23))
    assert len(cache.keys(a)) == 3 and cache.keys(a)[:2] == cache.keys(b)[:2] and cache.keys(a)[2] != cache.keys(b)[2]
    assert cache.keys([5, 6, 7, 8]) != cache.keys([6, 5, 7, 8])  # order matters
    src = _single_slot_caches(0)
    cache.store(a, src)  # 13 tokens: 3 full blocks kept
    assert len(cache) == 3 and cache.stored_blocks == 3
    assert len(cache.match(a)) == 3  # 12 of 13 tokens: the last one is always prefilled
    assert len(cache.match(a[:12])) == 2  # a 12-token prompt may reuse 8: its last token is prefilled
    assert len(cache.match(b)) == 2  # diverges in block 3
    assert len(cache.match(a, prefilled=5)) == 2 and len(cache.match(a, prefilled=6)) == 1  # 8 and 4 of 13 reused
    assert cache.match([1, 2, 3, 4, 5]) == []
    dst = [KVCache(torch.zeros_like(c.k), torch.zeros_like(c.v), c.seqlens.clone()) for c in src]
    assert cache.load(cache.match(b), dst) == 8
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d.k[:, :, :, :8], s.k[:, :, :, :8]) and torch.equal(d.v[:, :, :, :8], s.v[:, :, :, :8])
        assert not d.k[:, :, :, 8:].any()  # nothing past the reused blocks
    with pytest.raises(ValueError, match="one slot's caches"):
        cache.load(cache.match(a), [KVCache(torch.zeros(2, 2, 2, 64, 4), torch.zeros(2, 2, 2, 64, 4),
                                            torch.zeros(2, dtype=torch.int32))] * 2)


def test_eviction_keeps_within_the_limit_and_takes_leaves_before_roots() -> None:
    caches = _single_slot_caches(1)
    block_bytes = 2 * 2 * (2 * 2 * 4 * 4) * 4  # k and v, two caches, [layers, heads, block, dim], 4-byte fp32
    cache = PrefixCache(3 * block_bytes, block=4)
    a = list(range(100, 117))  # 4 full blocks
    cache.store(a, caches)
    assert len(cache) == 3 and cache.nbytes == 3 * block_bytes  # the chain's tail is dropped, not its own root
    assert len(cache.match(a)) == 3 and cache.evicted_blocks == 0
    b = list(range(200, 209))  # 2 full blocks
    cache.store(b, caches)
    assert cache.nbytes <= cache.max_bytes and cache.evicted_blocks == 2
    assert len(cache.match(a)) == 1 and len(cache.match(b + [0])) == 2  # a's two leaves went, its root stayed
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.mark.parametrize("method", OFFERED_METHODS)
def test_a_cached_prefix_gives_the_cold_runs_tokens(method: str) -> None:
    """4 requests on one document through 2 slots: the last two reuse its 5 blocks (the first two were admitted
    before either's prefill had finished), and every request, greedy or seeded-sampled, gets exactly the tokens of
    that method's generate() on its prompt alone. A drafter that reads the hidden states of the prompt's last R
    positions (the ring drafter's window: R = 16 here) reuses only the blocks that end before them (4 of 5 here)."""
    cache = PrefixCache(1 << 20, block=BLOCK)
    requests = _document_requests()
    batcher = make_batcher(method, slots=2, prefix_cache=cache)
    got = serve_requests(batcher, requests)
    rows = batcher.decoder.drafter.window_rows
    assert rows == (16 if METHODS[method].needs_ring else 0)
    assert cache.reused_tokens == (2 * 32 if rows else 2 * 40)
    for k, request in enumerate(requests):
        assert got[k] == _cold(method, request), f"request {k} ({request.sampling})"


@pytest.mark.parametrize("method", OFFERED_METHODS)
def test_admissions_prefilled_together_give_the_cold_runs_tokens(method: str) -> None:
    """Under a 160-token budget, 6 requests through 3 slots, admitted as slots free up: the waiting admissions'
    chunks share forwards (some target prefill forward carries 3 prompts), the later requests reuse the document's
    blocks, and every request, greedy or seeded-sampled, gets exactly its cold run's tokens."""
    cache = PrefixCache(1 << 20, block=BLOCK)
    requests = _document_requests(4) + [SlotRequest(_ids(prompt_text(130 + i, 30 + 7 * i)), 9) for i in range(2)]
    batcher = make_batcher(method, slots=3, prefix_cache=cache, prefill_budget=160)
    rows: list[int] = []

    def hook(module, args):
        if args[0].shape[1] > batcher.gamma + 1:  # a prefill chunk, not a round's Γ + 1 tokens
            rows.append(args[0].shape[0])

    handle = batcher.decoder.target.register_forward_pre_hook(hook)
    try:
        got = serve_requests(batcher, requests)
    finally:
        handle.remove()
    assert max(rows) == 3 and cache.reused_tokens >= (32 if batcher.decoder.drafter.window_rows else 40)
    for k, request in enumerate(requests):
        assert got[k] == _cold(method, request), f"request {k} ({request.sampling})"


@pytest.mark.parametrize("method", ["classic", "dustin-h"])
def test_eviction_under_memory_pressure_while_serving_stays_exact(method: str) -> None:
    """A limit of 6 blocks while 6 requests on two documents (5 and 4 blocks) come in the order A A B A B B: B's
    blocks evict A's leaves, A's return evicts B's, each reuses what is left of its chain, the cache never exceeds its
    limit, and every answer is still the cold run's."""
    probe = make_batcher(method, slots=1).decoder.start_prefill(slice(0, 1), [[2, 3]])
    per_block = sum(2 * c.k[:, 0, :, :BLOCK].numel() * c.k.element_size() for c in probe.caches)
    cache = PrefixCache(6 * per_block, block=BLOCK)
    batcher = make_batcher(method, slots=1, prefix_cache=cache)
    documents = {"A": DOCUMENT, "B": prompt_text(51, 32)}
    requests = [SlotRequest(_ids(documents[d] + prompt_text(70 + i, 5)), 10) for i, d in enumerate("AABABB")]
    got = serve_requests(batcher, requests)
    # reused: A 5 blocks, A 2 (B took 3), B 1 (A took 3), B 4; evicted: 3 + 3 + 3
    assert (cache.reused_tokens, cache.evicted_blocks) == ((5 + 2 + 1 + 4) * BLOCK, 9)
    assert cache.nbytes <= cache.max_bytes
    for k, request in enumerate(requests):
        assert got[k] == _cold(method, request), f"request {k}"


@pytest.mark.parametrize("method", ["classic", "dustin-h-sparse-draft", "longspark"])
def test_a_request_cancelled_mid_prefill_leaves_nothing_behind(method: str) -> None:
    """A prompt that reuses the document and has 3 chunks left is released after one of them: the cache keeps no
    block of it, its slot serves the next request, and that request (the same prompt again) is exact."""
    cache = PrefixCache(1 << 20, block=BLOCK)
    batcher = make_batcher(method, slots=1, prefix_cache=cache)
    first = SlotRequest(_ids(DOCUMENT + "?"), 4)
    long = SlotRequest(_ids(DOCUMENT + prompt_text(80, 40)), 8)
    serve_requests(batcher, [first])
    held, stored = len(cache), cache.stored_blocks
    with reference_kernels():
        slot, update = batcher.admit(long)
        assert update is None and batcher.prefilling == [slot]  # 40 tokens after the 40 reused: 3 chunks
        batcher.step()
        batcher.release(slot)
    assert not batcher.busy and batcher.free_slots == 1
    assert len(cache) == held and cache.stored_blocks == stored
    assert serve_requests(batcher, [long])[0] == _cold(method, long)


def test_a_larger_prefill_budget_admits_queued_prompts_in_fewer_steps() -> None:
    """Two 60-token prompts wait while a request decodes: with one 16-token chunk per step they take 8 steps to
    their first tokens; with a 70-token budget, 2 (the running request's 10 prompt tokens, prefilled by the first
    step with the first prompt's 4 chunks; then the second's); with 64, 3 (the first prompt's last chunk no longer
    fits the first step). Every step runs the running request's round, and all three get the cold runs' tokens."""
    running = SlotRequest(_ids(prompt_text(0, 10)), 40)
    queued = [SlotRequest(_ids(prompt_text(1 + i, 60)), 8) for i in range(2)]
    for budget, steps_to_first in ((None, 8), (70, 2), (64, 3)):
        batcher = make_batcher("classic", slots=3, prefill_budget=budget)
        with reference_kernels():
            slot_a, update = batcher.admit(running)
            assert (update is None) == (budget is not None)  # under a budget every prompt waits for step()
            got = {slot_a: list(update.tokens) if update else []}
            for request in queued:
                slot, update = batcher.admit(request)
                assert update is None
                got[slot] = []
            steps = 0
            while any(not got[s] for s in got):
                steps += 1
                a_done = bool(got[slot_a]) and (len(got[slot_a]) >= running.max_new_tokens or got[slot_a][-1] in EOS)
                updates = batcher.step()
                assert a_done or any(u.slot == slot_a and u.tokens for u in updates), f"budget {budget}: step {steps}"
                for u in updates:
                    got[u.slot] += u.tokens
                    if u.finished:
                        batcher.release(u.slot)
            assert steps == steps_to_first
            while batcher.busy:
                for u in batcher.step():
                    got[u.slot] += u.tokens
                    if u.finished:
                        batcher.release(u.slot)
        for slot, request in zip(sorted(got), [running, *queued], strict=True):
            assert got[slot] == _cold("classic", request), f"budget {budget}, slot {slot}"


def test_sixty_four_clients_on_shared_documents_through_the_engine() -> None:
    """The CPU load test: 64 concurrent clients, 4 documents x 16 questions, through an engine with prefix caching,
    a prefill budget and the fp8 draft cache: every answer is the cold run's (greedy), most prompt tokens come from
    the cache, and it stays within its limit."""
    config = SERVED.with_(methods=("classic", "dustin-h"), max_batch=4, queue_size=64, prefix_cache_mib=1,
                          prefix_block=BLOCK, prefill_budget=48, draft_kv_cache="fp8")
    documents = [prompt_text(90 + d, 32) for d in range(4)]
    requests = [GenerationRequest(documents[i % 4] + prompt_text(100 + i, 4 + i % 5), 6,
                                  method=("classic", "dustin-h")[i % 2]) for i in range(64)]
    with reference_kernels():
        engine = ServingEngine.from_config(config)
        try:
            answers = run_requests(engine, requests, timeout_s=600.0)
            caches = {m: b.prefix_cache for m, b in engine.batchers.items()}
        finally:
            engine.close()
    fp8 = SERVED.with_(methods=("classic", "dustin-h"), draft_kv_cache="fp8", max_batch=1, queue_size=64)
    with reference_kernels():
        cold = ServingEngine.from_config(fp8)
        try:
            want = run_requests(cold, requests, timeout_s=600.0)
        finally:
            cold.close()
    for r, chunks, reference in zip(requests, answers, want, strict=True):
        assert all(c.error is None for c in chunks), chunks[-1].error
        assert "".join(c.text for c in chunks) == "".join(c.text for c in reference), r.method
    prompt_tokens = sum(len(r.text) for r in requests)
    reused = sum(c.reused_tokens for c in caches.values())
    assert reused >= 0.5 * prompt_tokens, (reused, prompt_tokens)
    assert all(c.nbytes <= c.max_bytes for c in caches.values())


def test_serving_config_and_cli_check_the_scheduler_settings() -> None:
    with pytest.raises(ConfigError, match="prefix_cache_mib=-1 must be >= 0"):
        SERVED.with_(prefix_cache_mib=-1)
    with pytest.raises(ConfigError, match="prefill_budget=-1 must be >= 1, or 0 for one chunk per step"):
        SERVED.with_(prefill_budget=-1)
    with pytest.raises(ConfigError, match="prefix_block=0 must be >= 1"):
        SERVED.with_(prefix_block=0)
    with pytest.raises(ValueError, match="prefill_budget=0 must be >= 1 token"):
        make_batcher("vanilla", slots=1, prefill_budget=0)
    with pytest.raises(ValueError, match="block=0 must be >= 1 token"):
        PrefixCache(1, block=0)


def test_under_an_explicit_budget_admissions_wait_for_the_step_and_share_its_forwards() -> None:
    """With --prefill-budget 24, four 10-token prompts admitted in one pass: none is prefilled at admission; the first
    step prefills the first two (20 tokens) in one target forward and one draft forward, the third would overrun the
    budget; the second step prefills the other two the same way. All four get the cold runs' tokens."""
    requests = [SlotRequest(_ids(prompt_text(120 + i, 10)), 6) for i in range(4)]
    batcher = make_batcher("classic", slots=4, prefill_budget=24)
    rows: dict[str, list[int]] = {"target": [], "draft": []}  # the prompts in each prefill forward

    def count(name):
        def hook(module, args):
            tokens = args[0]  # [B, T]: a prefill chunk is longer than a round's Γ + 1 tokens
            if tokens.shape[1] > batcher.gamma + 1:
                rows[name].append(tokens.shape[0])
        return hook

    drafter_model = batcher.decoder.drafter.model
    handles = [batcher.decoder.target.register_forward_pre_hook(count("target")),
               drafter_model.register_forward_pre_hook(count("draft"))]
    got: dict[int, list[int]] = {}
    try:
        with reference_kernels():
            admitted = [batcher.admit(r) for r in requests]
            assert [u for _, u in admitted] == [None] * 4
            got = {slot: [] for slot, _ in admitted}
            firsts = []
            while batcher.busy:
                updates = batcher.step()
                firsts.append(sorted(u.slot for u in updates if u.first))
                for u in updates:
                    got[u.slot] += u.tokens
                    if u.finished:
                        batcher.release(u.slot)
    finally:
        for handle in handles:
            handle.remove()
    slots = [slot for slot, _ in admitted]
    assert firsts[:2] == [slots[:2], slots[2:]]
    assert rows == {"target": [2, 2], "draft": [2, 2]}  # two prefill forwards of each model, two prompts each
    for slot, request in zip(slots, requests, strict=True):
        assert got[slot] == _cold("classic", request)
