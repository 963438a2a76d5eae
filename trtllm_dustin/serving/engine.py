"""The serving engine: a bounded request queue in front of one in-flight batcher per served method.

    submit(request, on_chunk, cancelled)
                                validate, encode, queue (or refuse: QueueFullError)
    scheduler thread            drop cancelled requests -> admit waiting requests into free slots -> step every
                                busy batcher -> stream each request's new text -> release finished slots

A request is cancelled when its `cancelled()` says so (Triton: the client closed its stream or disconnected) or when
sending it a response fails: its slot is freed before the next step, it gets a final CANCELLED chunk, and the log
says which request went and after how many tokens.

Independent of Triton: the Python-backend model (triton_model.py) only converts tensors to GenerationRequests
and ResponseChunks to responses, so this file is tested in-process too.

Metrics (stats.py): every request's outcome, its tokens, time to first token and between tokens, each round's
committed length and phase times, the queue, the slots and the caches' use; written as a snapshot file that the HTTP
front exports (`metrics_path`, or none).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtllm_dustin.build_engines.engine import check_serves, open_engine
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import load_longspark
from trtllm_dustin.models.quantize import quantize_draft
from trtllm_dustin.models.ring_drafter import load_ring_drafter
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.kv_dtype import draft_kv_dtype
from trtllm_dustin.runtime.build import attention_backend, build_runtime, runtime_kernels
from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.inflight import InflightBatcher, SlotRequest, SlotUpdate
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.prefix_cache import PrefixCache
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.serving.config import ServingConfig
from trtllm_dustin.serving.stats import ACCEPTED_BUCKETS, LATENCY_BUCKETS, PHASE_BUCKETS, EngineMetrics, SnapshotWriter
from trtllm_dustin.serving.text import IncrementalDetokenizer, StopStrings, TextCodec, codec_for
from trtllm_dustin.validation import HTTP, check_options, check_request_length

PHASE_SAMPLE_EVERY = 16  # on a GPU, the rounds whose phases the metrics time: one in this many

__all__ = ["DRAIN_FILE_ENV", "GenerationRequest", "QueueFullError", "RequestError", "RequestStats", "ResponseChunk",
           "ServedDecoders", "ServingEngine", "served_decoders"]

# Set by the launcher (launch.py) in the server's environment: the file it writes when the server is told to stop,
# holding the seconds running requests get to finish before they are cut (so that Triton's own exit wait ends cleanly).
DRAIN_FILE_ENV = "TRTLLM_DUSTIN_DRAIN_FILE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request that cannot run as sent; the message names the value, the limit and the fix."""


class QueueFullError(RuntimeError):
    """Every slot is busy and the waiting queue is at its bound; the client should retry later."""


@dataclass(frozen=True)
class GenerationRequest:
    text: str
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings: generation ends before the first one, which is not returned
    method: str | None = None  # None = the model's default method
    stream: bool = False  # send text pieces as they are committed (decoupled mode only)
    input_ids: tuple[int, ...] | None = None  # the prompt as token ids instead of `text`
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs, through the model's chat template
    fit_max_tokens: bool = False  # max_tokens is an upper bound: lowered to what the model holds after the prompt


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # speculative rounds (vanilla: decode steps) this request took part in
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0  # drafted for this request: rounds x gamma
    time_to_first_token_ms: float = float("nan")  # from submit (queue wait included) to the first token
    decode_tokens_per_s: float = float("nan")  # tokens after the first / time from the first to the last
    finish_reason: str = ""  # once finished: "stop" (end of sequence or a stop string) or "length" (max_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round (accepted drafts + the target's token), as the runtime's tau; 1 for vanilla."""
        return (self.accepted_draft_tokens + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class ResponseChunk:
    text: str  # the new text (streaming) or the whole text (non-streaming final chunk)
    final: bool
    stats: RequestStats
    error: str | None = None
    cancelled: bool = False  # the final chunk of a cancelled request (its error says so)


@dataclass
class _Job:
    request: GenerationRequest
    method: str
    slot_request: SlotRequest
    on_chunk: Callable[[ResponseChunk], None]
    detok: IncrementalDetokenizer
    stops: StopStrings
    stats: RequestStats
    cancelled: Callable[[], bool] | None = None  # the transport's "has the client gone?"
    number: int = 0  # the engine's request number, for the log
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float = 0.0
    last_token: float = 0.0  # when the previous piece was committed (inter-token latency)
    slot: int = -1
    text: list[str] = field(default_factory=list)  # non-streaming: pieces so far
    gone: bool = False  # sending to it failed: drop it before the next step


class ServingEngine:
    """Loads the models once, serves GenerationRequests from a scheduler thread."""

    def __init__(self, config: ServingConfig, batchers: dict[str, InflightBatcher], codec: TextCodec,
                 vocab_size: int | None = None, metrics_path: str | Path | None = None) -> None:
        """metrics_path: where the metrics snapshot is written (stats.py); None: kept in `self.metrics` only."""
        self.config, self.batchers, self.codec, self.vocab_size = config, batchers, codec, vocab_size
        self._waiting: deque[_Job] = deque()
        self._running: dict[tuple[str, int], _Job] = {}
        self.metrics = EngineMetrics()
        self._set_gauges()
        self._metrics_writer = None if metrics_path is None else SnapshotWriter(self.metrics, metrics_path)
        self._cv = threading.Condition()
        self._stopping = False
        self._submitted = 0
        self._steps = dict.fromkeys(batchers, 0)  # steps per method, for the sampled phase timing
        self.cancelled_requests = 0  # requests dropped because their client went away
        self.drain_file = os.environ.get(DRAIN_FILE_ENV)
        self._drain_deadline: float | None = None  # set once the server is stopping: running requests end by then
        self._thread = threading.Thread(target=self._loop, name="dustin-scheduler", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: ServingConfig, metrics_path: str | Path | None = None) -> ServingEngine:
        served = served_decoders(config)
        def prefix_cache() -> PrefixCache | None:
            mib = config.prefix_cache_mib
            return PrefixCache(mib * 2**20, config.prefix_block) if mib else None

        batchers = {method: InflightBatcher(decoder, served.eos_token_ids, config.prefill_chunk,
                                            config.prefill_budget or None, prefix_cache())
                    for method, decoder in served.decoders.items()}
        engine = cls(config, batchers, served.codec, served.vocab_size, metrics_path)
        if served.device.type == "cuda":
            engine.warm_up()
        return engine

    def warm_up(self, timeout_s: float = 600.0) -> None:
        """One short request per method before serving: Triton kernels compile and CUDA graphs are captured while
        the model loads, not inside the first client's request (where a long stall makes the server's health
        check give up on the backend process)."""
        for method in self.batchers:
            done, errors = threading.Event(), []

            def on_chunk(chunk: ResponseChunk, done=done, errors=errors) -> None:
                if chunk.error:
                    errors.append(chunk.error)
                if chunk.final:
                    done.set()

            self.submit(GenerationRequest(text="warm up " * 8, max_tokens=2 * self.config.gamma + 4, method=method),
                        on_chunk)
            if not done.wait(timeout_s) or errors:
                raise RuntimeError(f"warm-up of method {method} failed: {errors or f'no answer in {timeout_s} s'}")

    # ---- requests ----------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_chunk: Callable[[ResponseChunk], None],
               cancelled: Callable[[], bool] | None = None) -> None:
        """Queue a request; `on_chunk` is called from the scheduler thread with its pieces, the last one final.
        `cancelled` (optional) is asked before every step whether the client has gone; then the request is dropped.

        Raises RequestError for a request that cannot run and QueueFullError when the queue is at its bound."""
        method = request.method or self.config.method
        try:
            self._queue(self._job(request, method, on_chunk, cancelled))
        except RequestError:
            self.refused("invalid", method)
            raise
        except QueueFullError:
            self.refused("rejected", method)
            raise

    def refused(self, outcome: str, method: str | None = None) -> None:
        """Count a request refused before it was queued (the model's own checks count theirs here too)."""
        self.metrics.count("dustin_requests", method=method if method in self.batchers else "unknown",
                           outcome=outcome)

    def _job(self, request: GenerationRequest, method: str, on_chunk: Callable[[ResponseChunk], None],
             cancelled: Callable[[], bool] | None) -> _Job:
        if method not in self.batchers:
            raise RequestError(f"method {method!r} is not served by this model; choose one of "
                               f"{', '.join(self.batchers)} (regenerate the repository with --method to serve others)")
        batcher = self.batchers[method]
        field = "input_ids" if request.input_ids is not None else "messages" if request.messages is not None else \
            "text_input"
        max_tokens = request.max_tokens
        try:
            check_options({"max_tokens": max_tokens, "temperature": request.temperature,
                           "top_p": request.top_p, "seed": request.seed}, HTTP)
            if request.stream and not self.config.decoupled:
                raise RequestError("stream=true needs the decoupled model; regenerate the repository with --decoupled")
            if request.input_ids is not None:
                prompt = self._check_ids(request.input_ids)
            elif request.messages is not None:
                prompt = self.codec.encode_chat(request.messages)
            else:
                prompt = self.codec.encode(request.text)
            if request.fit_max_tokens:  # as many as the model holds after the prompt, at most max_tokens
                max_tokens = max(1, min(max_tokens, batcher.cache.max_seq_len - len(prompt) - batcher.gamma))
            check_request_length(field, len(prompt), max_tokens, batcher.gamma, batcher.cache.max_seq_len)
        except ValueError as e:  # InputError, or the codec's: a character outside a tokenizer-less vocabulary
            raise RequestError(str(e)) from None
        sampling = SamplingParams(request.temperature, request.top_p, request.seed)
        slot_request = SlotRequest(tuple(prompt), max_tokens, sampling)
        return _Job(request, method, slot_request, on_chunk, IncrementalDetokenizer(self.codec),
                    StopStrings(request.stop), RequestStats(prompt_tokens=len(prompt)), cancelled)

    def _queue(self, job: _Job) -> None:
        with self._cv:
            if self._stopping or self._drain_deadline is not None:
                raise QueueFullError("the server is shutting down; send the request to another instance")
            if len(self._waiting) >= self.config.queue_size:
                busy = sum(b.batch_slots - b.free_slots for b in self.batchers.values())
                raise QueueFullError(f"the request queue is full ({len(self._waiting)} waiting, {busy} slots busy); "
                                     "retry later, or regenerate the repository with a larger --queue-size or "
                                     "--max-batch")
            self._submitted += 1
            job.number = self._submitted
            self._waiting.append(job)
            self.metrics.set("dustin_queue_depth", len(self._waiting))
            self._cv.notify()

    def _check_ids(self, ids: tuple[int, ...]) -> list[int]:
        if not ids:
            raise RequestError("input_ids is empty; send at least one token id")
        bad = next((i for i in ids if i < 0 or (self.vocab_size is not None and i >= self.vocab_size)), None)
        if bad is not None:
            raise RequestError(f"input_ids holds {bad}, outside this model's vocabulary [0, {self.vocab_size}); "
                               "tokenize with the model's own tokenizer")
        return list(ids)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the scheduler; requests still queued or running are answered with an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._metrics_writer is not None:
            self._metrics_writer.close()
        for job in [*self._waiting, *self._running.values()]:
            _send(job, ResponseChunk("", True, job.stats, error="the server shut down before the request finished"))
        self._waiting.clear()
        self._running.clear()

    # ---- the scheduler -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._running:
                    self._cv.wait(timeout=1.0)
                if self._stopping:
                    return
                self._drain()
                self._drop_cancelled()
                admit = self._take_admissible()
            for job in admit:
                self._admit(job)
            for method, batcher in self.batchers.items():
                if batcher.busy:
                    self._steps[method] += 1
                    # CUDA events between graph replays can delay launches (phase_timer.py): on a GPU one round in
                    # PHASE_SAMPLE_EVERY is timed; the CPU's wall clock costs nothing and times every round
                    timed = batcher.device.type != "cuda" or self._steps[method] % PHASE_SAMPLE_EVERY == 1
                    timer = PhaseTimer(timed, batcher.device)
                    try:
                        updates = batcher.step(timer)
                    except Exception as e:  # noqa: BLE001 - reported to every affected client, then serving goes on
                        self._fail_running(method, e)
                        continue
                    for phase, ms in timer.totals_ms().items():  # after the step's own host sync: no wait here
                        self.metrics.observe("dustin_phase_seconds", PHASE_BUCKETS, ms / 1e3, method=method,
                                             phase=phase)
                    for update in updates:
                        job = self._running.get((method, update.slot))
                        if job is not None:  # None: dropped earlier in this step (its client went away)
                            self._deliver(job, update)
            self._set_gauges()

    def _set_gauges(self) -> None:
        """The queue, the slots and the caches' use, for the metrics (from the scheduler thread, after each step)."""
        self.metrics.set("dustin_queue_depth", len(self._waiting))
        jobs = list(self._running.values())
        for method, batcher in self.batchers.items():
            mine = [job for job in jobs if job.method == method]
            self.metrics.set("dustin_running_slots", batcher.batch_slots - batcher.free_slots, method=method)
            self.metrics.set("dustin_slots", batcher.batch_slots, method=method)
            self.metrics.set("dustin_kv_cache_tokens", sum(j.stats.prompt_tokens + j.stats.generated_tokens
                                                           for j in mine), method=method)
            self.metrics.set("dustin_kv_cache_capacity_tokens", batcher.batch_slots * batcher.cache.max_seq_len,
                             method=method)
            cache = batcher.prefix_cache
            self.metrics.set("dustin_prefix_cache_bytes", cache.nbytes if cache else 0, method=method)
            self.metrics.set("dustin_prefix_cache_capacity_bytes", cache.max_bytes if cache else 0, method=method)
            self.metrics.set("dustin_prefix_cache_reused_tokens", cache.reused_tokens if cache else 0,
                             method=method)

    def _drain(self) -> None:
        """When the launcher says the server is stopping (DRAIN_FILE_ENV): refuse what waits, give the running requests
        the grace period the file names, then cut them with an error (called under the lock)."""
        if self.drain_file is None:
            return
        now = time.perf_counter()
        if self._drain_deadline is None:
            try:
                grace = float(Path(self.drain_file).read_text() or 10)
            except (OSError, ValueError):
                return  # not stopping (or the file is being written: seen at the next step)
            self._drain_deadline = now + grace
            print(f"dustin: the server is stopping: {len(self._running)} running request(s) get {grace:.0f} s to "
                  f"finish, {len(self._waiting)} waiting one(s) are refused", file=sys.stderr, flush=True)
            for job in self._waiting:
                self._finished(job, "error")
                _send(job, ResponseChunk("", True, job.stats, error="the server is shutting down; the request was not "
                                         "started, send it to another instance"))
            self._waiting.clear()
        if now < self._drain_deadline or not self._running:
            return
        for job in list(self._running.values()):
            print(f"dustin: request {job.number} ({job.method}) cut after {job.stats.generated_tokens} tokens: the "
                  "server is stopping", file=sys.stderr, flush=True)
            self._end(job, ResponseChunk("", True, job.stats, error=f"the server is shutting down; the request was "
                                         f"cut after {job.stats.generated_tokens} tokens"))

    def _drop_cancelled(self) -> None:
        """Free the slots of requests whose client has gone, and forget waiting ones (called under the lock)."""
        for job in [*self._waiting, *self._running.values()]:
            if not job.gone:
                try:
                    job.gone = bool(job.cancelled is not None and job.cancelled())
                except Exception:  # noqa: BLE001 - a transport that cannot tell is treated as still there
                    job.gone = False
            if not job.gone:
                continue
            waiting = job in self._waiting
            self.cancelled_requests += 1
            print(f"dustin: request {job.number} ({job.method}) cancelled by its client after "
                  f"{job.stats.generated_tokens} tokens; {'waiting' if waiting else f'slot {job.slot}'} freed",
                  file=sys.stderr, flush=True)
            # Triton still wants the final response of a cancelled request; its client will not read it (a failed
            # send is expected and not logged).
            self._end(job, ResponseChunk("", True, job.stats, error="the request was cancelled", cancelled=True),
                      quiet=True)

    def _take_admissible(self) -> list[_Job]:
        """Waiting jobs that have a free slot of their method, oldest first (called under the lock)."""
        free = {method: b.free_slots for method, b in self.batchers.items()}
        admit = []
        for job in self._waiting:
            if free[job.method] > 0:
                free[job.method] -= 1
                admit.append(job)
        for job in admit:
            self._waiting.remove(job)
        return admit

    def _admit(self, job: _Job) -> None:
        batcher = self.batchers[job.method]
        try:
            slot, update = batcher.admit(job.slot_request)
        except Exception as e:  # noqa: BLE001 - the client gets the error; other requests are unaffected
            print(f"dustin: request {job.number} ({job.method}): prefill failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            self._finished(job, "error")
            _send(job, ResponseChunk("", True, job.stats, error=f"prefill failed: {type(e).__name__}: {e}"))
            return
        self.metrics.count("dustin_prompt_tokens", job.stats.prompt_tokens, method=job.method)
        job.slot = slot
        self._running[(job.method, slot)] = job
        if update is not None:  # a prompt of one prefill chunk: its first token is here (longer ones: from step())
            self._deliver(job, update)

    def _fail_running(self, method: str, error: Exception) -> None:
        for job in [j for (m, _), j in self._running.items() if m == method]:
            self._end(job, ResponseChunk("", True, job.stats, error=f"generation failed: {type(error).__name__}: "
                                         f"{error}"))

    def _end(self, job: _Job, chunk: ResponseChunk, quiet: bool = False) -> None:
        """A job leaves before it finished (cancelled, cut, failed): forget it, free its slot, send its final chunk."""
        self._finished(job, "cancelled" if chunk.cancelled else "error")
        if job in self._waiting:
            self._waiting.remove(job)
        elif self._running.get((job.method, job.slot)) is job:
            del self._running[(job.method, job.slot)]
            self.batchers[job.method].release(job.slot)
        if not quiet:
            _send(job, chunk)
            return
        try:
            job.on_chunk(chunk)
        except Exception:  # noqa: BLE001 - its connection is already closed
            pass

    def _finished(self, job: _Job, outcome: str) -> None:
        self.metrics.count("dustin_requests", method=job.method, outcome=outcome)

    def _deliver(self, job: _Job, update: SlotUpdate) -> None:
        stats, method, now = job.stats, job.method, time.perf_counter()
        if update.first:
            job.first_token = now
            stats.time_to_first_token_ms = (job.first_token - job.submitted) * 1e3
            self.metrics.observe("dustin_time_to_first_token_seconds", LATENCY_BUCKETS, now - job.submitted,
                                 method=method)
        elif update.tokens:  # a round's tokens arrive together: each gets an equal share of the wait
            self.metrics.observe("dustin_inter_token_latency_seconds", LATENCY_BUCKETS,
                                 (now - job.last_token) / len(update.tokens), len(update.tokens), method=method)
        job.last_token = now
        stats.generated_tokens += len(update.tokens)
        self.metrics.count("dustin_generated_tokens", len(update.tokens), method=method)
        if not update.first:
            stats.rounds += 1
            stats.accepted_draft_tokens += update.accepted
            stats.draft_tokens += self.batchers[job.method].gamma
            self.metrics.observe("dustin_accepted_length", ACCEPTED_BUCKETS, update.accepted + 1, method=method)
        if stats.generated_tokens > 1:
            elapsed = time.perf_counter() - job.first_token
            stats.decode_tokens_per_s = (stats.generated_tokens - 1) / elapsed if elapsed > 0 else float("nan")
        done = update.finished
        text = job.stops.feed(job.detok.push(update.tokens, final=done), final=done)
        if job.stops.stopped and not done:  # a stop string ended it early: flush nothing more, free the slot
            done = True
        if done:
            stats.finish_reason = "stop" if job.stops.stopped or \
                stats.generated_tokens < job.slot_request.max_new_tokens else "length"
        if done:
            self.batchers[job.method].release(job.slot)
            del self._running[(job.method, job.slot)]
            self._finished(job, "ok")
        if job.request.stream:
            if text or done:
                job.gone = not _send(job, ResponseChunk(text, done, stats)) and not done
        else:
            job.text.append(text)
            if done:
                _send(job, ResponseChunk("".join(job.text), True, stats))


def _send(job: _Job, chunk: ResponseChunk) -> bool:
    """Hand a chunk to the transport; a failing client (gone, cancelled) must not stop the scheduler. False when
    sending failed (the request is then dropped before the next step)."""
    try:
        job.on_chunk(chunk)
        return True
    except Exception as e:  # noqa: BLE001 - logged; the other requests go on
        print(f"dustin: request {job.number} ({job.method}): sending a response failed ({type(e).__name__}: {e}); "
              "its client has probably gone", file=sys.stderr, flush=True)
        if not isinstance(e, (ConnectionError, OSError)):
            traceback.print_exc()
        return False


@dataclass
class ServedDecoders:
    """What a ServingConfig builds: one decoder per served method over the models loaded once, and the text codec."""

    decoders: dict[str, Decoder]
    codec: TextCodec
    vocab_size: int  # prompt ids must be below it (the smaller of the target's and the draft's tables)
    eos_token_ids: tuple[int, ...]
    device: torch.device


def served_decoders(config: ServingConfig, batch_slots: int | None = None) -> ServedDecoders:
    """Load the models of `config` and build each served method's decoder with `batch_slots` slots (default
    config.max_batch): the serving engine's own construction, also what the tests run `generate()` on."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda but no CUDA device is visible; regenerate the repository with --device cpu")
    slots = batch_slots or config.max_batch
    dtype = _DTYPES[config.dtype] if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    speculative = any(METHODS[m].needs_draft for m in config.methods)
    needs_spark = any(METHODS[m].needs_longspark for m in config.methods)
    needs_ring = any(METHODS[m].needs_ring for m in config.methods)
    tactics = None  # an engine's own tactic table
    dustin, spark_spec, ring_spec = config.dustin, config.longspark, config.ring
    draft_kv_cache, draft_weights = config.draft_kv_cache, config.draft_weights
    if config.engine is not None:  # checked (format, sha256s, fingerprints, memory) before anything loads
        engine = open_engine(config.engine, device=device, serving=True)
        check_serves(engine, config.methods)
        limits = engine.manifest.limits  # the engine's dtype and draft choices, whatever the config says
        dtype, dustin, draft_kv_cache, draft_weights = limits.torch_dtype, engine.dustin, limits.draft_kv_cache, \
            limits.draft_weights
        loaded = engine.target.load(device, dtype)
        draft = engine.draft.load(device, dtype).model if speculative else None
        spark_spec = str(engine.longspark) if needs_spark else None
        ring_spec = str(engine.ring) if needs_ring else None
        tactics = engine.tactics
    else:
        loaded = load_model(config.model, device=device, dtype=dtype, seed=config.weights_seed)
        draft = load_model(config.draft, device=device, dtype=dtype, seed=config.weights_seed + 1,
                           share_with=loaded.model).model if speculative else None
    if draft is not None:  # on its device and dtype, before a runtime is built on it or a CUDA graph captured
        quantize_draft(draft, draft_weights)
    longspark = load_longspark(spark_spec, loaded.model, seed=config.weights_seed + 1) if needs_spark else None
    kernels = runtime_kernels(KernelConfig.from_env(), tactics)  # the TRTLLM_DUSTIN_* switches, read once for all
    ring = load_ring_drafter(ring_spec, loaded.model, weights=draft_weights, seed=config.weights_seed + 2,
                             wide=kernels.int8_wide) if needs_ring else None
    backend = attention_backend(device, kernels, config.backend)
    decoders = {method: build_runtime(  # each method keeps its own KV caches
        method, loaded.model, draft=draft, longspark=longspark, ring=ring, dustin=dustin, batch_slots=slots,
        max_seq_len=config.max_seq_len, dtype=dtype, draft_kv_dtype=draft_kv_dtype(draft_kv_cache, dtype),
        device=device, kernels=kernels, backend=backend, gamma=config.gamma, draft_budget=config.draft_budget,
        use_cuda_graph=config.use_cuda_graph) for method in config.methods}
    # Prompt ids must embed in both models: a draft may have a smaller (padded) vocabulary than its target
    # (Qwen2.5-0.5B 151936, Qwen2.5-7B 152064), and an id past the draft's table fails inside its embedding.
    vocab = loaded.model.config.vocab_size if draft is None else min(loaded.model.config.vocab_size,
                                                                     draft.config.vocab_size)
    return ServedDecoders(decoders, codec_for(loaded.tokenizer, vocab, config.chat_template), vocab,
                          tuple(loaded.model.config.eos_token_ids), device)
