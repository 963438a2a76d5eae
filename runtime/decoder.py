"""The one decode loop: a target model verifies what a Drafter proposed, against what a Selector chose.

    prefill(slots) -> [draft -> estimate -> select -> verify -> accept -> commit] per round

Every caller runs this `Decoder.round`: `generate()` below (a static batch), the in-flight batcher (inflight.py:
requests join and leave slots between rounds), the quality evaluation (teacher-forced acceptor) and the
benchmarks (stated-distribution acceptor). A method is a (Drafter, Selector) pair (methods.py); vanilla decoding is
the pair (no draft, full verification), whose round verifies the last token alone and commits the target's next.

Every round runs all batch slots so the captured shapes never change; slots without a sequence are idle
(state.py). The round has no host sync: the drafter's steps, the estimate, the selection and the verification are
fixed-shape phases (CUDA graphs on the GPU) and the commit is one kernel. On the CPU, where nothing is captured and
reading a tensor costs no sync, the verification computes only the busy slots' rows, up to their longest sequence
(`_busy_rows`): a served request alone in a batch of idle slots then decodes at generate()'s rate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime import phases
from trtllm_dustin.runtime.acceptor import Acceptor, Verdict
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Drafter, PrefillView
from trtllm_dustin.runtime.generation import GenerationConfig, GenerationResult, check_request
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.prefill import PrefillJob, group_jobs, prefill_chunk_for, slot_range, step_together
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Progress, RoundState

__all__ = ["Decoder", "SlotPrefill"]


class Decoder:
    def __init__(self, name: str, target: Transformer, cache: KVCache, drafter: Drafter, selector: Selector,
                 backend: AttentionBackend, graphs: PhaseGraphs, kernels: KernelConfig, shared_vocab: int) -> None:
        self.name, self.target, self.cache, self.backend = name, target, cache, backend
        self.drafter, self.selector, self.graphs, self.kernels = drafter, selector, graphs, kernels
        self.gamma = drafter.gamma
        self.device = cache.seqlens.device
        # The ids the pair shares (phases.mask_shared): the target proposes no other.
        self.shared_vocab = shared_vocab
        self.state = RoundState.allocate(cache.seqlens)
        with torch.inference_mode():  # the cache may have been allocated under inference mode
            self.state.idle(slice(None))
        slots, config = cache.batch_slots, target.config
        self.verify_tokens = torch.zeros(slots, self.gamma + 1, dtype=torch.long, device=self.device)
        # The target layers whose queries the drafter or the selector read, kept at the prompt end and every round.
        layers = tuple(sorted(set(selector.target_query_layers) | set(drafter.target_query_layers)))
        self.target_query_layers = layers
        dtype = target.embed.weight.dtype  # the model's, not the cache's (which may be fp8)
        self.verify_queries = {layer: torch.zeros(slots, self.gamma + 1, config.num_heads, config.head_dim,
                                                  dtype=dtype, device=self.device) for layer in layers}
        # The target layers whose hidden states (block outputs) the drafter reads (LongSpark's boundary state).
        self.target_hidden_layers = tuple(drafter.target_hidden_layers)
        self.verify_hidden = {layer: torch.zeros(slots, self.gamma + 1, config.hidden_size, dtype=dtype,
                                                 device=self.device) for layer in self.target_hidden_layers}
        self._capture = QueryCapture(layers, dict(self.verify_queries), dict(self.verify_hidden)) \
            if layers or self.target_hidden_layers else None
        # A selector that re-runs the target over the round's tokens (the evaluation oracle) reads the round state.
        selector.bind(self.state)
        self.acceptors = phases.Acceptors(kernels.round_kernels)
        self._untimed = PhaseTimer(False, self.device)

    # ---- slots -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int = 2048) -> torch.Tensor:
        """Write the prompts into both caches at slots [start, stop), run the per-slot hooks, and return the
        target's logits of each prompt's next token [n, V] (ids outside the shared vocabulary masked)."""
        job = self.start_prefill(slots, prompts, chunk)
        while not job.step():
            pass
        return job.logits

    def start_prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int = 2048, start: int = 0
                      ) -> SlotPrefill:
        """`prefill` one chunk at a time: the in-flight batcher runs decode rounds of the other slots between the
        chunks (the slots wait parked, runtime/prefill.py). start > 0: the prompts' first `start` positions are
        put into the caches by the caller (`SlotPrefill.caches`, a reused prefix) before the first step."""
        return SlotPrefill(self, slots, prompts, chunk, start)

    @torch.inference_mode()
    def prefilled(self, slots: slice, prompts: Sequence[Sequence[int]], queries: dict[int, torch.Tensor],
                  hidden: dict[int, torch.Tensor] | None = None, window: dict[int, torch.Tensor] | None = None,
                  window_start: int = 0) -> None:
        """The caches already hold the prompts at slots [start, stop) (a prefill shared by several decoders):
        set the slots' lengths and run the drafter's and selector's prompt-time hooks. queries: target layer ->
        [n, H_q, D], the last prompt token's query, for at least the decoder's target_query_layers; hidden: target
        layer -> [n, H], its hidden state, for at least target_hidden_layers; window: target layer -> [n, R, H], the
        last R positions' hidden states, for a drafter with `window_layers` (window_start: the first position the
        prefill ran)."""
        hidden = hidden or {}
        missing = [layer for layer in self.target_hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(f"{self.name} reads the target's hidden states at layers {missing}; the prefill given "
                             "kept none (pass hidden_out to prefill)")
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device)
        self.state.lengths[slots] = lengths
        view = PrefillView(slots, [list(p) for p in prompts], lengths,
                           {layer: queries[layer] for layer in self.target_query_layers},
                           {layer: hidden[layer] for layer in self.target_hidden_layers}, window or {}, window_start)
        self.drafter.on_prefill(view)
        self.selector.on_prefill(view)

    @torch.inference_mode()
    def begin(self, progress: Progress, slots: slice, first: torch.Tensor, prompts: Sequence[Sequence[int]],
              limits: int | Sequence[int]) -> None:
        """Slots start generating: `first` [n] is each one's first token (phases.first_tokens of the prefill
        logits)."""
        phases.begin(self.state, progress, slots, first, prompts, limits)

    @torch.inference_mode()
    def release(self, progress: Progress, slot: int) -> None:
        """A slot stops (finished or cancelled) and runs along idle until its next admission."""
        progress.active[slot] = False
        self.state.idle(slice(slot, slot + 1))

    # ---- one round: the phases (phases.py) in order ----------------------------------------------------------
    @torch.inference_mode()
    def round(self, progress: Progress, sampling: SlotSampling, acceptor: Acceptor | None = None,
              timer: PhaseTimer | None = None) -> Verdict:
        """draft -> estimate -> select -> verify -> accept -> commit, for every slot, without a host sync.
        acceptor: None picks greedy acceptance when every slot is greedy and rejection sampling otherwise."""
        phase = timer or self._untimed
        rows = self._busy_rows(progress)  # the CPU: the slots from the first to the last busy one
        with phase("draft"):
            proposal = self.drafter.propose(self.state, sampling, rows)  # tokens [B, Γ]
        indices = self._select(phase)  # sparse verification: what the target reads this round (None: all)
        with phase("verify"):
            logits = self.graphs.run("verify", partial(self._verify, proposal.tokens, indices, rows))  # [B, Γ+1, V]
        with phase("accept"):
            verdict = phases.accept(self.acceptors, proposal, logits, progress, sampling, acceptor)
            phases.observe_and_commit(self.verify_tokens, verdict, progress, self.state, indices, self.verify_queries,
                                      self.verify_hidden, (self.drafter, self.selector), self.kernels.round_kernels)
        return verdict

    def _select(self, phase: PhaseTimer) -> torch.Tensor | None:
        """The estimate and select phases, each a captured graph: the round's set, or None (full verification)."""
        return phases.choose(self.selector, self.state.lengths, phase, self.graphs.run)

    def _busy_rows(self, progress: Progress) -> slice | None:
        """The slots the CPU drafts and verifies: from the first to the last one still generating. Idle slots'
        outputs are discarded, and on the CPU each row costs: a projection of 8 rows takes 4-5 times one row's time (a
        GEMV reads the weights once; a small GEMM computes). None on the GPU, whose captured phases keep every slot
        (and where reading `active` would be a host sync)."""
        if self.device.type != "cpu":
            return None
        busy = progress.active.nonzero()  # a CPU tensor: a host read, no device sync
        return slice(int(busy[0]), int(busy[-1]) + 1) if busy.numel() else None

    def _verify(self, draft_tokens: torch.Tensor, indices: torch.Tensor | None, rows: slice | None = None
                ) -> torch.Tensor:
        """The target over each slot's Γ+1 tokens (the last committed one and the drafts) -> logits [B, Γ+1, V];
        with `rows` (the CPU) over those slots only, reading each cache up to its longest sequence, the other slots'
        logits zero (they are idle: their verdicts are never committed)."""
        self.verify_tokens[:, 0] = self.state.cur
        self.verify_tokens[:, 1:] = draft_tokens
        in_pass = None if indices is None else self.selector.in_pass
        if rows is None:
            meta = AttentionMetadata(cache_seqlens=self.state.lengths, indices=indices, in_pass=in_pass)
            logits = self.target(self.verify_tokens, self.cache, meta, self.backend, capture=self._capture)
            return self.shared_logits(logits)  # [B, Γ+1, V]
        lengths = self.state.lengths[rows]
        if indices is not None:
            indices = indices[rows]
        meta = AttentionMetadata(cache_seqlens=lengths, indices=indices,
                                 max_kv_len=int(lengths.max()) + self.gamma + 1,
                                 in_pass=None if in_pass is None else in_pass.rows(rows))
        capture = None if self._capture is None else QueryCapture(
            self._capture.layers, {layer: q[rows] for layer, q in self._capture.queries.items()},
            {layer: h[rows] for layer, h in self._capture.hidden.items()})  # views: the writes land in the buffers
        part = self.target(self.verify_tokens[rows], slot_range(self.cache, rows), meta, self.backend,
                           capture=capture)  # [n, Γ+1, V]
        logits = part.new_zeros((self.cache.batch_slots, *part.shape[1:]))
        logits[rows] = part
        return self.shared_logits(logits)

    def shared_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits with ids outside the pair's shared vocabulary masked out."""
        return phases.mask_shared(logits, self.shared_vocab)

    @torch.inference_mode()
    def capture(self, greedy: bool = True, progress: Progress | None = None) -> None:
        """JIT and capture every phase before timing starts. Their side effects (K/V at positions past the committed
        length, drafted tokens, scores, the set) are all rewritten by the next real round before being read; no
        randomness is drawn. With `progress` (and greedy rounds) the eager kernels of acceptance and commit compile
        here too, on copies of the state: the first timed round would otherwise pay their JIT (about 0.3 s on the
        H200 in a fresh process, a tenth of a second per round over a short run)."""
        if not self.graphs.enabled:
            return
        proposal = self.drafter.capture(self.state, greedy)
        indices = self._select(self._untimed)
        logits = self.graphs.run("verify", partial(self._verify, proposal.tokens, indices))
        if progress is None or not greedy:
            return
        verdict = self.acceptors.greedy.accept(proposal, logits, progress, None)  # a pure function of its inputs
        phases.warm_up_commit(self.verify_tokens, verdict, progress, self.state, self.kernels.round_kernels)

    # ---- a static batch ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig, profile: bool = False
                 ) -> GenerationResult:
        """Decode every prompt (slots 0 .. B-1) to EOS or max_new_tokens. The first token is sampled with seed + 1,
        the rounds with seed, one generator for the batch."""
        check_request(prompts, self.cache, config.max_new_tokens, lookahead=self.gamma)
        B, slots, device = len(prompts), self.cache.batch_slots, self.device
        timer = PhaseTimer(profile, device)
        use_kernel = self.kernels.round_kernels
        sampling = SlotSampling.batch(config.sampling, slots, device, use_kernel=use_kernel)
        progress = Progress.allocate(slots, config.max_new_tokens, self.gamma, config.eos_token_ids, device)

        _sync(device)
        t0 = time.perf_counter()
        self.state.idle(slice(None))
        logits = self.prefill(slice(0, B), prompts, config.prefill_chunk or prefill_chunk_for(B))
        first = phases.first_tokens(logits, config.sampling, use_kernel)
        self.begin(progress, slice(0, B), first, prompts, config.max_new_tokens)
        _sync(device)
        t_first = time.perf_counter()  # every sequence has its first token: the time to first token
        self.capture(sampling.all_greedy, progress)  # one-time cost, kept out of both times
        _sync(device)
        t1 = time.perf_counter()

        clock = _RoundClock(device)
        finished = phases.FinishCheck(device, config.sync_every, config.run_ahead)
        decoding = torch.zeros((), dtype=torch.long, device=device)  # rounds that began with a sequence active
        rounds = 0
        if bool(progress.active.any()):
            for rounds in range(1, config.max_new_tokens + 1):  # every round commits >= 1 token per active slot
                decoding += progress.active.any()  # on the device: no sync
                self.round(progress, sampling, timer=timer)
                clock.tick()
                if finished(progress.active, rounds):
                    break
        _sync(device)
        t2 = time.perf_counter()
        round_ms = clock.elapsed_ms()
        decoding_rounds = int(decoding)  # a slot never restarts within a run: the decoding rounds come first
        return GenerationResult(tokens=progress.tokens(B), prefill_ms=(t_first - t0) * 1e3,
                                setup_ms=(t1 - t_first) * 1e3, decode_ms=(t2 - t1) * 1e3,
                                rounds=rounds, decoding_rounds=decoding_rounds,
                                decoding_ms=round_ms[decoding_rounds - 1] if decoding_rounds else 0.0,
                                round_ms=round_ms, committed_hist=progress.hist.tolist(), phase_ms=timer.totals_ms())


class _RoundClock:
    """When each round ended, from the start of the decode: a CUDA event per round on the GPU (read after the final
    sync, so the loop keeps its one host sync), the host clock on the CPU (whose ops run synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[float | torch.cuda.Event] = []
        self.start = self._mark()

    def _mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def tick(self) -> None:
        self.marks.append(self._mark())

    def elapsed_ms(self) -> list[float]:
        """Milliseconds from the start to the end of each round (call after a device sync)."""
        if self.cuda:
            return [self.start.elapsed_time(mark) for mark in self.marks]
        return [(mark - self.start) * 1e3 for mark in self.marks]


class SlotPrefill:
    """A Decoder's prefill of some slots in progress: each `step()` writes the next chunk into the target's cache and
    the drafter's own; after the last one the slots' lengths are set, the hooks have run and `logits` holds the
    target's next-token logits [n, V] (ids outside the shared vocabulary masked)."""

    def __init__(self, decoder: Decoder, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0
                 ) -> None:
        self.decoder, self.slots, self.prompts = decoder, slots, prompts
        n, dtype, device = len(prompts), decoder.target.embed.weight.dtype, decoder.device
        self.hidden = {layer: torch.zeros(n, decoder.target.config.hidden_size, dtype=dtype, device=device)
                       for layer in decoder.target_hidden_layers}
        self.start = start
        self.target = PrefillJob(decoder.target, decoder.cache, decoder.backend, prompts, chunk,
                                 decoder.target_query_layers, hidden_out=self.hidden, start=start, slots=slots,
                                 window_layers=decoder.drafter.window_layers, window_rows=decoder.drafter.window_rows)
        self.draft = decoder.drafter.prefill(slots, prompts, chunk, start)  # None: the drafter keeps no cache
        self.logits: torch.Tensor | None = None

    @property
    def done(self) -> int:
        """Prompt tokens written so far (every prompt of the job advances together)."""
        return self.target.done

    @property
    def finished(self) -> bool:
        return self.logits is not None

    @property
    def remaining(self) -> int:
        """Prompt positions still to write (of the job's longest prompt)."""
        return self.target.remaining

    @property
    def caches(self) -> list[KVCache]:
        """The caches this prefill writes, restricted to its slots: the target's, then the drafter's own if any."""
        return [self.target.view] + ([self.draft.view] if self.draft is not None else [])

    def step(self) -> bool:
        """The next chunk in both caches; True once the prompts are complete and the slots ready to begin."""
        return SlotPrefill.step_together([self])[0]

    @staticmethod
    @torch.inference_mode()
    def step_together(prefills: Sequence[SlotPrefill]) -> list[bool]:
        """The next chunk of several prefills of one decoder: those on adjacent slots share a target forward and a
        drafter forward (runtime/prefill.py: group_jobs, step_together); per prefill, whether it is complete (its
        hooks then ran)."""
        if any(p.finished for p in prefills):
            raise RuntimeError("this prefill has no chunk left")
        for jobs in ([p.target for p in prefills],
                     [p.draft for p in prefills if p.draft is not None and not p.draft.finished]):
            for group in group_jobs(jobs):  # the draft's chunks end where the target's do; its cache has own limits
                step_together(group)
        complete = [p.target.finished for p in prefills]
        for p, done in zip(prefills, complete, strict=True):
            if done:
                logits, queries = p.target.last_logits, p.target.last_queries
                p.decoder.prefilled(p.slots, p.prompts, queries, p.hidden, p.target.hidden_window, p.start)
                p.logits = p.decoder.shared_logits(logits)
        return complete


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
