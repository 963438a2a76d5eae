"""In-flight batching and the serving engine in-process (no server): the same answers as the runtime's own
generate(), whatever shares the batch; streaming pieces, stop strings, errors and the queue bound."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.serving import (
    DUSTIN,
    EOS,
    SERVED,
    direct_text,
    make_batcher,
    prompt_text,
    reference_kernels,
    run_requests,
    serve_requests,
    served_ring_drafter,
)

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.cli import main
from trtllm_dustin.runtime.inflight import SlotRequest
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.serving import ServingConfig, write_model_repository
from trtllm_dustin.serving.engine import GenerationRequest, QueueFullError, RequestError, ServingEngine
from trtllm_dustin.serving.text import CodepointCodec, IncrementalDetokenizer, StopStrings

# Every registered method, named here on purpose: registering a method fails test_every_method_is_covered until it
# is added (with whatever setup it needs) to the in-flight parity test below.
COVERED = ("vanilla", "classic", "magicdec", "dustin-h", "dustin-t", "dustin-d", "dustin-h-sparse-draft",
           "streamingllm", "snapkv", "quest", "dustin-h-adaptive", "longspark", "dustin-h-longspark",
           "dustin-t-longspark", "dustin-h-accum", "dustin-h-kv-head", "dustin-ip", "dustin-ip-pages",
           "dustin-ip-sparse-draft", "dustin-ip-la", "dustin-ip-dense", "dustin-ip-longspark", "ring",
           "dustin-ip-ring", "dustin-ip-ring-full-feed")
# Evaluation methods that decide for the whole batch on the host (the oracles' extra full pass, periodic full
# rounds counted per batch): never served, so they have no in-flight parity to keep.
BATCH_WIDE = ("oracle", "oracle-layer", "oracle-kv-head", "dustin-h-periodic")


def test_every_method_is_covered() -> None:
    assert set(COVERED) | set(BATCH_WIDE) == set(METHODS), f"covered {sorted(COVERED)}, registered {sorted(METHODS)}"
    assert all(METHODS[m].eager_only and not METHODS[m].offered for m in BATCH_WIDE)


def _requests(n: int, sampled_every: int = 2) -> list[SlotRequest]:
    g = torch.Generator().manual_seed(5)
    return [SlotRequest([ord(c) for c in prompt_text(i, int(torch.randint(1, 40, (1,), generator=g)))],
                        int(torch.randint(1, 30, (1,), generator=g)),
                        SamplingParams(0.9, 0.85, seed=100 + i) if i % sampled_every == 0 else SamplingParams(0.0))
            for i in range(n)]


@pytest.mark.parametrize("method", COVERED)
def test_inflight_batching_equals_single_sequence_generate(method: str) -> None:
    """10 requests (greedy and sampled, own limits, prompts of 1-39 tokens so that the sparse methods both keep all
    and select) through 3 slots, admitted as slots free up: each gets exactly what that method's own generate()
    gives its prompt alone (with its seed, for the sampled ones)."""
    requests = _requests(10)
    got = serve_requests(make_batcher(method, slots=3), requests)
    for k, r in enumerate(requests):
        s = r.sampling
        want = direct_text(method, "".join(map(chr, r.prompt)), r.max_new_tokens, s.temperature, s.top_p, s.seed)
        assert "".join(map(chr, got[k])) == want, f"request {k} ({s})"


@pytest.mark.parametrize("method", ["classic", "dustin-h-sparse-draft"])
def test_seeded_requests_repeat_whatever_shares_the_batch(method: str) -> None:
    """All-sampled requests served twice, through 3 slots and then through 2 in another admission order, repeat
    exactly; another seed changes them."""
    requests = _requests(6, sampled_every=1)
    first = serve_requests(make_batcher(method, slots=3), requests)
    again = serve_requests(make_batcher(method, slots=2), requests[::-1])
    assert all(again[len(requests) - 1 - k] == tokens for k, tokens in first.items())
    reseeded = [SlotRequest(r.prompt, r.max_new_tokens, SamplingParams(0.9, 0.85, seed=r.sampling.seed + 1))
                for r in requests]
    assert serve_requests(make_batcher(method, slots=3), reseeded) != first


def test_sampled_requests_with_a_draft_of_a_smaller_padded_vocabulary(tmp_path: Path) -> None:
    """A draft whose table has fewer rows than the target's (as Qwen2.5-0.5B's 151936 against 7B's 152064): sampled
    requests through the in-flight path take the draft's distributions over the shared ids only."""
    from trtllm_dustin.models.loading import _empty_model, _random_init
    from trtllm_dustin.models.presets import get_preset

    small = _empty_model(get_preset("tiny-llama-draft").with_(vocab_size=200, name="small-vocab"), torch.device("cpu"),
                         torch.float32, None)
    _random_init(small, seed=3)
    requests = [SlotRequest([ord(c) for c in prompt_text(i, 12 + i) if ord(c) < 200], 20,
                            SamplingParams(1.0, 0.95, seed=i)) for i in range(5)]
    for method in ("classic", "dustin-h"):
        got = serve_requests(make_batcher(method, slots=2, draft=small), requests)
        for k, r in enumerate(requests):
            assert max(got[k]) < 200
            want = direct_text(method, "".join(map(chr, r.prompt)), r.max_new_tokens, 1.0, 0.95, k, draft=small)
            assert "".join(map(chr, got[k])) == want, f"{method} request {k}"


@pytest.mark.parametrize("method", ["vanilla", "classic", "dustin-h", "longspark"])
def test_long_prompt_is_prefilled_between_the_rounds_of_the_others(method: str) -> None:
    """A prompt of 4 prefill chunks admitted while another request decodes: one chunk per step, the running request
    commits tokens in every one of those steps (it never waits for the whole prefill), and both get exactly what
    generate() gives each alone. A request cancelled while it prefills frees its slot for the next one."""
    batcher = make_batcher(method, slots=2)
    running = SlotRequest([ord(c) for c in prompt_text(0, 10)], 29)
    long = SlotRequest([ord(c) for c in prompt_text(1, 60)], 12)

    def drain(got: dict[int, list[int]]) -> None:
        while batcher.busy:
            for u in batcher.step():
                got[u.slot] += u.tokens
                if u.finished:
                    batcher.release(u.slot)

    with reference_kernels():
        slot_a, update = batcher.admit(running)
        got = {slot_a: list(update.tokens)}
        slot_b, update = batcher.admit(long)
        assert update is None and batcher.prefilling == [slot_b]
        got[slot_b] = []
        steps = 0
        while not got[slot_b]:
            steps += 1
            a_done = len(got[slot_a]) >= running.max_new_tokens or got[slot_a][-1] in EOS
            updates = batcher.step()
            assert a_done or any(u.slot == slot_a and u.tokens for u in updates), f"step {steps}: slot a stalled"
            for u in updates:
                assert u.first == (u.slot == slot_b and not got[slot_b])
                got[u.slot] += u.tokens
                if u.finished:
                    batcher.release(u.slot)
        assert steps == 4  # 60 tokens in chunks of 16
        drain(got)
        cancelled, update = batcher.admit(long)
        assert update is None
        batcher.step()
        batcher.release(cancelled)  # mid-prefill
        again, _ = batcher.admit(long)
        retry = {again: []}
        drain(retry)
    for slot, r in ((slot_a, running), (slot_b, long)):
        assert "".join(map(chr, got[slot])) == direct_text(method, "".join(map(chr, r.prompt)), r.max_new_tokens)
    assert retry[again] == got[slot_b]


def test_admission_refuses_what_cannot_fit() -> None:
    batcher = make_batcher("classic", slots=1)
    with pytest.raises(ValueError, match=r"--max-seq-len 96 is smaller than prompt 0 \(90 tokens\)"):
        batcher.admit(SlotRequest(list(range(2, 92)), 10))
    batcher.admit(SlotRequest([5, 6], 4))
    with pytest.raises(RuntimeError, match="no free batch slot"):
        batcher.admit(SlotRequest([5, 6], 4))


@pytest.fixture(scope="module")
def engine():
    with reference_kernels():
        eng = ServingEngine.from_config(SERVED.with_(queue_size=8))
        yield eng
        eng.close()


def test_engine_streaming_pieces_concatenate_to_the_direct_text(engine: ServingEngine) -> None:
    requests = [GenerationRequest(prompt_text(i, 12 + i), 20, temperature=0.7 * (i % 2), seed=i,
                                  method=("classic", "vanilla", "dustin-h")[i % 3], stream=i % 2 == 0)
                for i in range(8)]
    for r, chunks in zip(requests, run_requests(engine, requests), strict=True):
        assert all(c.error is None for c in chunks) and chunks[-1].final and not any(c.final for c in chunks[:-1])
        text = "".join(c.text for c in chunks)
        assert text == direct_text(r.method, r.text, r.max_tokens, r.temperature, r.top_p, r.seed)
        stats = chunks[-1].stats
        assert stats.generated_tokens == len(text) and stats.time_to_first_token_ms > 0
        if r.method == "vanilla":
            assert stats.mean_accepted_length == 1 and stats.draft_tokens == 0
        else:
            assert 1 <= stats.mean_accepted_length <= SERVED.gamma + 1
            assert stats.draft_tokens == SERVED.gamma * stats.rounds


def test_engine_serves_every_offered_method_exactly() -> None:
    """One engine serving every method the CLI offers: concurrent greedy and sampled requests for each, each answered
    with that method's generate() text."""
    with reference_kernels():
        eng = ServingEngine.from_config(SERVED.with_(methods=OFFERED_METHODS, max_batch=2, queue_size=64))
        try:
            requests = [GenerationRequest(prompt_text(i, 10 + 3 * (i % 20)), 14, temperature=0.8 * (i % 2), seed=i,
                                          method=method, stream=i % 2 == 0)
                        for i, method in enumerate(m for m in OFFERED_METHODS for _ in range(2))]
            for r, chunks in zip(requests, run_requests(eng, requests), strict=True):
                assert all(c.error is None for c in chunks), (r.method, chunks[-1].error)
                want = direct_text(r.method, r.text, r.max_tokens, r.temperature, r.top_p, r.seed,
                                   ring=served_ring_drafter())
                assert "".join(c.text for c in chunks) == want, r.method
        finally:
            eng.close()


def test_engine_cuts_at_a_stop_string(engine: ServingEngine) -> None:
    text = prompt_text(3, 10)
    full = direct_text("vanilla", text, 30)
    stop = full[12:14]
    [chunks] = run_requests(engine, [GenerationRequest(text, 30, stop=(stop,), method="vanilla", stream=True)])
    assert "".join(c.text for c in chunks) == full[: full.index(stop)]


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest("abc", 0), r"max_tokens=0 must be in 1..2147483647 \(an INT32"),
    (GenerationRequest("abc", 4, method="medusa"), "method 'medusa' is not served by this model; choose one of"),
    (GenerationRequest("a" * 90, 10), r"max_tokens=10 does not fit: this model holds 96 positions per request, 3 of "
     r"them kept free for a round's draft tokens, and text_input takes 90; send max_tokens <= 3"),
    (GenerationRequest("\u4e2d", 4), "U\\+4E2D is outside this model's 257-token vocabulary"),
    (GenerationRequest("abc", 4, temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (GenerationRequest("", 4), "text_input is empty; send at least one token"),
])
def test_engine_refuses_bad_requests_clearly(engine: ServingEngine, request_: GenerationRequest, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        engine.submit(request_, lambda chunk: None)


def test_a_cancelled_request_frees_its_slot_and_the_others_go_on(engine: ServingEngine, capfd) -> None:
    """A streaming request whose client goes away after two pieces (its `cancelled()` turns true), one that is
    cancelled while it still waits, and one whose transport fails on sending: each is dropped (a final CANCELLED
    chunk, the slot freed, a log line), and the request running beside them answers exactly."""
    batcher = engine.batchers["classic"]
    gone, chunks, done = threading.Event(), [], threading.Event()

    def on_chunk(chunk) -> None:
        chunks.append(chunk)
        if len(chunks) == 2:
            gone.set()
        if chunk.final:
            done.set()

    long = GenerationRequest(prompt_text(40, 9), 60, method="classic", stream=True)
    engine.submit(long, on_chunk, cancelled=gone.is_set)
    never_admitted = threading.Event()
    waiting = [GenerationRequest(prompt_text(41, 5), 30, method="classic") for _ in range(SERVED.max_batch + 1)]
    waiting_done = [threading.Event() for _ in waiting]
    for request, event in zip(waiting, waiting_done, strict=True):  # more than the free slots: the last one waits
        engine.submit(request, lambda c, event=event: c.final and event.set(), cancelled=never_admitted.is_set)
    never_admitted.set()  # every one of them is cancelled now, running or waiting

    def failing(chunk) -> None:
        raise ConnectionResetError("the client closed the connection")

    engine.submit(GenerationRequest(prompt_text(42, 6), 60, method="classic", stream=True), failing)
    [other] = run_requests(engine, [GenerationRequest(prompt_text(43, 7), 12, method="classic")])
    assert other[-1].error is None and other[-1].text == direct_text("classic", prompt_text(43, 7), 12)
    assert done.wait(60) and all(event.wait(60) for event in waiting_done)
    assert chunks[-1].final and chunks[-1].cancelled and chunks[-1].error == "the request was cancelled"
    assert len(chunks) <= 4 and chunks[-1].stats.generated_tokens < 60  # it did not run to its limit
    deadline = time.monotonic() + 30
    while batcher.free_slots < batcher.batch_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert batcher.free_slots == batcher.batch_slots  # every slot is free again
    log = capfd.readouterr().err
    assert log.count("cancelled by its client") >= 1 + len(waiting)
    assert "sending a response failed (ConnectionResetError" in log and "waiting freed" in log


def test_engine_queue_bound() -> None:
    eng = ServingEngine.from_config(SERVED.with_(methods=("vanilla",), max_batch=1, queue_size=2))
    try:
        gate = threading.Event()
        finished = threading.Semaphore(0)
        eng.submit(GenerationRequest("ab", 60), lambda c: (gate.wait(30), c.final and finished.release()))
        accepted, refused = 1, []
        for _ in range(6):
            try:
                eng.submit(GenerationRequest("ab", 4), lambda c: c.final and finished.release())
                accepted += 1
            except QueueFullError as e:
                refused.append(str(e))
        gate.set()
        assert accepted <= 4 and refused and "the request queue is full" in refused[0] and "--queue-size" in refused[0]
        for _ in range(accepted):
            assert finished.acquire(timeout=60)
    finally:
        eng.close()


def test_incremental_detokenizer_holds_partial_characters() -> None:
    class Bytes:  # a byte-level codec: a multi-byte character spans tokens
        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, ids) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    text = "a\u00e9\u4e2d\U0001f600 z"
    detok = IncrementalDetokenizer(Bytes())
    ids = Bytes().encode(text)
    pieces = [detok.push([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stop_strings_across_pieces() -> None:
    stops = StopStrings(["END", "xy"])
    out = "".join(stops.feed(p) for p in ["hello E", "N", "D world"])
    assert out == "hello " and stops.stopped
    assert CodepointCodec(300).decode(CodepointCodec(300).encode("Az\u0101")) == "Az\u0101"


def _answers_as_the_runtime(eng: ServingEngine, method: str) -> None:
    """Three prompts of growing length through the engine: each answer is the runtime's greedy text."""
    requests = [GenerationRequest(prompt_text(i, 14 + i), 16, method=method) for i in range(3)]
    for r, chunks in zip(requests, run_requests(eng, requests), strict=True):
        assert all(c.error is None for c in chunks)
        assert "".join(c.text for c in chunks) == direct_text(method, r.text, 16)


def test_fp8_draft_cache_serves_the_targets_greedy_text() -> None:
    """Classic SD with the draft's cache in fp8 answers exactly as the runtime with a full-precision draft cache."""
    fp8 = SERVED.with_(methods=("classic",), draft_kv_cache="fp8", queue_size=4)
    assert ServingConfig.from_json(fp8.to_json()) == fp8
    with reference_kernels():
        eng = ServingEngine.from_config(fp8)
        try:
            assert eng.batchers["classic"].decoder.drafter.cache.k.dtype == torch.float8_e4m3fn
            _answers_as_the_runtime(eng, "classic")
        finally:
            eng.close()
    with pytest.raises(ValueError, match="draft_kv_cache 'int4' must be 'model' or 'fp8'"):
        SERVED.with_(draft_kv_cache="int4")


def test_int8_draft_weights_serve_the_targets_greedy_text() -> None:
    """Classic SD with the draft's layers in weight-only int8 answers exactly as the runtime with the draft as loaded;
    a repository written before draft_weights reads as "model"; another value is refused with the accepted ones."""
    import json

    from trtllm_dustin.models.quantize import Int8Linear

    int8 = SERVED.with_(methods=("classic",), draft_weights="int8", queue_size=4)
    assert ServingConfig.from_json(int8.to_json()) == int8
    old = json.loads(SERVED.to_json())
    del old["draft_weights"]
    assert ServingConfig.from_json(json.dumps(old)).draft_weights == "model"
    with reference_kernels():
        eng = ServingEngine.from_config(int8)
        try:
            draft = eng.batchers["classic"].decoder.drafter.model
            linears = [m for m in draft.layers.modules() if isinstance(m, (Int8Linear, torch.nn.Linear))]
            assert len(linears) == 4 * len(draft.layers) and all(isinstance(m, Int8Linear) for m in linears)
            _answers_as_the_runtime(eng, "classic")
        finally:
            eng.close()
    with pytest.raises(ValueError, match="draft_weights 'int4' must be 'model' or 'int8'"):
        SERVED.with_(draft_weights="int4")


def test_serving_config_round_trips_and_validates(tmp_path: Path) -> None:
    assert ServingConfig.from_json(SERVED.to_json()) == SERVED
    with pytest.raises(ValueError, match="need a draft model"):
        ServingConfig(methods=("classic",))
    with pytest.raises(ValueError, match="unknown"):
        ServingConfig(methods=("beam",))


def test_cli_writes_a_repository(tmp_path: Path, capsys) -> None:
    dustin = tmp_path / "dustin.json"
    DUSTIN.save(dustin)
    assert main(["triton-repo", "--out", str(tmp_path / "repo"), "--model", "preset:tiny-llama", "--draft",
                 "preset:tiny-llama-draft", "--method", "dustin-h", "vanilla", "--dustin-config", str(dustin),
                 "--max-batch", "2", "--max-seq-len", "64", "--no-decoupled"]) == 0
    model = tmp_path / "repo" / "dustin"
    pbtxt = (model / "config.pbtxt").read_text()
    assert "max_batch_size: 2" in pbtxt and "decoupled: false" in pbtxt and 'name: "text_output"' in pbtxt
    assert "from trtllm_dustin.serving.triton_model import TritonPythonModel" in (model / "1" / "model.py").read_text()
    config = ServingConfig.load(model / "1" / "serving_config.json")
    assert config.methods == ("dustin-h", "vanilla") and config.dustin == DUSTIN and not config.decoupled
    assert "wrote" in capsys.readouterr().out
    assert main(["triton-repo", "--out", str(tmp_path / "r2"), "--method", "dustin-h", "--draft", "preset:x"]) == 2
    write_model_repository(tmp_path / "repo", SERVED, "second")
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["dustin", "second"]


def test_prompt_ids_must_embed_in_the_draft_too(tmp_path) -> None:
    """A draft with a smaller vocabulary than its target (as Qwen2.5-0.5B's 151936 against 7B's 152064): prompt ids
    past the draft's table are refused with a clear error, not left to fail inside the draft's embedding."""
    from trtllm_dustin.models.loading import _empty_model, _random_init, save_hf_checkpoint
    from trtllm_dustin.models.presets import get_preset

    small = _empty_model(get_preset("tiny-llama-draft").with_(vocab_size=200, name="small-vocab"), torch.device("cpu"),
                         torch.float32, None)
    _random_init(small, seed=3)
    save_hf_checkpoint(small, tmp_path / "draft")
    eng = ServingEngine.from_config(SERVED.with_(draft=str(tmp_path / "draft"), methods=("classic",)))
    try:
        assert eng.vocab_size == 200
        with pytest.raises(RequestError, match=r"input_ids holds 230, outside this model's vocabulary \[0, 200\)"):
            eng.submit(GenerationRequest("", 4, input_ids=(5, 230)), lambda chunk: None)
        done = threading.Event()
        chunks = []
        eng.submit(GenerationRequest("", 4, input_ids=(5, 199)), lambda c: (chunks.append(c), c.final and done.set()))
        assert done.wait(60) and chunks[-1].final and chunks[-1].error is None
    finally:
        eng.close()
