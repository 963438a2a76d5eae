"""Pipeline-parallel decoding: the target's layers in contiguous stages on P processes, every supported method's
round spread over them, M micro-batches in flight.

Each rank holds one PipelineStage (its layers' weights only) and, per micro-batch, a KV cache of its layers, the
round state and the run's Progress. The first stage (rank 0) also holds the draft, the method's Drafter and
Selector (built by the registry, runtime/methods.py) and the draft's caches; the last stage has the logits and
decides acceptance. One round of one micro-batch, message by message (tags are the _Tag names):

    rank 0       draft Γ tokens (the Drafter), estimate + select I_verify (selection.py: S_target arrives
                 from the stages that own the SRH layers), embed [cur, drafts] and run its layers
    0 -> 1       HIDDEN [b, Γ+1, H], TOKENS int64 [b, Γ+1], INDICES int32 [b, k] (sparse methods)
    s -> s+1     the same, after stage s's layers (every stage reads the same I_verify: it is layer-invariant; with
                 in-pass selection the stage that owns a selection layer rewrites it in its pass and sends the new one)
    0 -> last    sampled rounds only: PROBS fp32 [b, Γ, V] (rejection sampling's q) and STATES, the generator
                 state(s) after drafting (one for the batch, or one per sampled slot)
    last         its layers, the logits, acceptance (greedy or rejection sampling, drawing from STATES)
    last -> all  VERDICT int64 [2, b]: accepted counts and next tokens; -> 0: STATES after acceptance, and with
                 in-pass selection CHOSEN int32 [b, k], the set the pass chose (after the prefill: SEED, round 1's)
    s -> s+1, last -> 0   a LongSpark draft whose target layers live past rank 0: LS_KV, LS_HIDDEN, those layers'
                 K/V rows and hidden states of the verified tokens (after the prefill: of the prompts), gathered
                 stage by stage; rank 0 writes the rows into its copy of them (runtime/pipeline/longspark.py)
    every rank   observes the verdict (the drafter's and the selector's hooks on rank 0, the target history on the
                 SRH stages), commits its own KV / state / Progress (commit_round), and decides identically whether
                 the micro-batch goes on; an SRH stage then scores S_target of the next round -> 0: S_TARGET

Every phase is the single-process round's own function (runtime/phases.py: first_tokens, begin, choose, accept,
observe_and_commit, FinishCheck without polling); this module only moves tensors between the stages around them.

Seeded sampling is token-identical to the single-process Decoder: the generator state travels with the messages,
so the draft's draws (rank 0) and acceptance's draws (last stage) come from one sequence, in the single-process
order. With micro-batches every slot samples from its own generator (seed + slot, as in-flight serving does),
because the batch's one generator cannot be shared by micro-batches in flight.

The schedule (`_Schedule`): time advances in ticks; at tick t stage s works on the item rank 0 started at t - s,
and a micro-batch starts again right after its verdict, so with M >= P micro-batches every stage is busy every tick
(stage s works on micro-batch (t - s) mod M). Sends are non-blocking, receives block; every pair of ranks sends
and receives its messages in the same order, so the schedule needs no collective and no barrier.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads, model_fingerprint
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.models.longspark import LongSpark, LongSparkConfig
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime import phases
from trtllm_dustin.runtime.acceptor import Acceptor, Verdict
from trtllm_dustin.runtime.build import build_runtime
from trtllm_dustin.runtime.cuda_graph import CapturedStep
from trtllm_dustin.runtime.drafter import Drafter, PrefillView, Proposal
from trtllm_dustin.runtime.generation import GenerationConfig, GenerationResult, check_lengths
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.pipeline.group import PipelineGroup
from trtllm_dustin.runtime.pipeline.layers import check_split, layer_split
from trtllm_dustin.runtime.pipeline.longspark import LongSparkRelay
from trtllm_dustin.runtime.pipeline.selection import TargetHistory, pipeline_method, sum_in_order
from trtllm_dustin.runtime.pipeline.stage import PipelineStage
from trtllm_dustin.runtime.prefill import PrefillJob, prefill_chunk_for
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.selectors import InPassSelector
from trtllm_dustin.runtime.state import Progress, RoundState

__all__ = ["PipelineBench", "PipelineDecoder", "PipelineSetup"]


class _Tag(IntEnum):
    HIDDEN = 1
    TOKENS = 2
    INDICES = 3
    PROBS = 4
    STATES = 5
    VERDICT = 6
    S_TARGET = 7
    PREFILL = 8
    FIRST = 9
    SEED = 10  # in-pass selection: round 1's set, from the owner of the first selection layer to the first stage
    CHOSEN = 11  # in-pass selection: the set the pass chose, from the last stage to the first
    LS_KV = 12  # a LongSpark draft: the K/V rows of the layers it reads past the first stage (pipeline/longspark.py)
    LS_HIDDEN = 13  # and their hidden states


@dataclass(frozen=True)
class PipelineSetup:
    """One rank's part of a pipeline-parallel decoder; every rank passes the same values but its own stage (and the
    first stage the draft model)."""

    method: str
    stage: PipelineStage
    group: PipelineGroup
    backend: AttentionBackend
    batch_slots: int  # sequences decoded together, over all micro-batches
    max_seq_len: int  # KV cache length per slot: prompt + new tokens + gamma
    draft_config: ModelConfig | None = None  # every rank (the pair's shared vocabulary); methods with a draft
    draft: Transformer | None = None  # the first stage only
    longspark_config: LongSparkConfig | None = None  # every rank (the target layers it reads); LongSpark methods
    longspark: LongSpark | None = None  # the first stage only, attached to a target model that holds those layers
    gamma: int = 3  # draft tokens per round (vanilla: 0)
    draft_budget: int = 512  # MagicDec's window; the baselines' k without a Dustin config
    dustin: DustinConfig | None = None
    micro_batches: int = 1  # M micro-batches in flight; M >= P keeps every stage busy
    kv_dtype: torch.dtype | None = None  # the target cache's (None: the stage's weights')
    draft_kv_dtype: torch.dtype | None = None  # the draft cache's (None: the draft's weights')
    use_cuda_graph: bool = True  # the drafter's steps and each micro-batch's stage forward (CUDA only)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # [start, stop) target layers of every rank (an engine's manifest); None: layer_split's even split
    layers: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        pipeline_method(self.method)
        stage, group = self.stage, self.group
        if group.world < 2:
            raise ConfigError("a pipeline needs at least 2 processes; with one, use the single-process Decoder "
                              "(trtllm-dustin generate without torchrun)")
        if (stage.rank, stage.pp_size) != (group.rank, group.world):
            raise ConfigError(f"stage {stage.rank} of {stage.pp_size} runs on rank {group.rank} of {group.world}")
        expected = self.stage_layers[stage.rank]
        if (stage.start, stage.stop) != expected:
            raise ConfigError(f"rank {stage.rank} holds layers [{stage.start}, {stage.stop}); the split gives it "
                              f"[{expected[0]}, {expected[1]})")
        if not 1 <= self.micro_batches <= self.batch_slots:
            raise ConfigError(f"--micro-batches {self.micro_batches} must be between 1 and --batch-size "
                              f"{self.batch_slots}")
        spec = METHODS[self.method]
        if spec.needs_draft and self.draft_config is None:
            raise ConfigError(f"method {self.method} needs a draft model; pass --draft (every rank needs its config)")
        if spec.needs_draft and stage.first and self.draft is None:
            raise ConfigError(f"method {self.method}: the first stage holds the draft; load it on rank 0")
        if spec.needs_dustin and self.dustin is None:
            raise ConfigError(f"{self.method} needs a Dustin configuration; pass --dustin-config FILE")
        if spec.needs_longspark:
            if self.longspark_config is None:
                raise ConfigError(f"method {self.method} needs a LongSpark drafter; every rank needs its config "
                                  "(PipelineSetup.longspark_config)")
            self.longspark_config.check_target(stage.config)
            if stage.first and (self.longspark is None or self.longspark.config != self.longspark_config):
                raise ConfigError(f"method {self.method}: the first stage holds the LongSpark drafter of "
                                  "longspark_config; load it on rank 0 (PipelineSetup.longspark)")

    @property
    def stage_layers(self) -> list[tuple[int, int]]:
        """Every rank's [start, stop) target layers."""
        n, p = self.stage.config.num_layers, self.stage.pp_size
        return layer_split(n, p) if self.layers is None else check_split(self.layers, n, p)

    @property
    def speculative_gamma(self) -> int:
        return self.gamma if METHODS[self.method].speculative else 0

    def facts(self) -> dict[str, str]:
        """What every rank must agree on (the start handshake)."""
        return {"method": self.method, "gamma": str(self.speculative_gamma), "batch": str(self.batch_slots),
                 "max_seq_len": str(self.max_seq_len), "micro_batches": str(self.micro_batches),
                 "pipeline stages": str(self.stage.pp_size), "layer split": str(self.stage_layers),
                 "target": model_fingerprint(self.stage.config), "draft budget": str(self.draft_budget),
                 "dustin config": hashlib.sha256(self.dustin.to_json().encode()).hexdigest()[:16]
                 if self.dustin is not None else "none",
                 "draft": model_fingerprint(self.draft_config) if self.draft_config is not None else "none",
                 "longspark": hashlib.sha256(self.longspark_config.to_json().encode()).hexdigest()[:16]
                 if self.longspark_config is not None else "none",
                 "target weights dtype": str(next(self.stage.parameters()).dtype)}


@dataclass(frozen=True)
class PipelineBench:
    """One rank's timed rounds of `PipelineDecoder.bench`."""

    context: int
    rounds: int  # rounds of every micro-batch
    ms: float  # this rank's wall time, from the moment every stage was ready to its last commit
    committed: int  # tokens the rounds committed over all slots
    slots: int

    @property
    def ms_per_round(self) -> float:
        """Time between two rounds of one micro-batch (with M >= P micro-batches, the stages work on the others in
        between)."""
        return self.ms / self.rounds


@dataclass
class _MicroBatch:
    """One micro-batch's state on this rank: its slots' caches, round state and run (shared weights)."""

    slots: slice  # global batch slots [start, stop)
    cache: KVCache  # this stage's layers
    state: RoundState  # lengths are the cache's seqlens
    # the verified tokens' queries of the SRH layers this stage owns and hidden states of the LongSpark layers it
    # owns (global keys)
    capture: QueryCapture | None
    history: TargetHistory | None  # S_target of those layers
    chooser: InPassSelector | None = None  # in-pass selection on a later stage that owns a selection layer (local)
    relay: LongSparkRelay | None = None  # a LongSpark draft: the layers it reads, on this stage
    drafter: Drafter | None = None  # the first stage
    selector: Selector | None = None
    # the first stage: each SRH layer's S_target of the next round (received, or its own part's buffer) and their sum
    s_target: dict[int, torch.Tensor] = field(default_factory=dict)
    s_target_sum: torch.Tensor | None = None
    # per run
    prompts: int = 0  # prompts in this micro-batch (its first slots)
    progress: Progress | None = None
    sampling: SlotSampling | None = None  # the first and last stages
    tokens: torch.Tensor | None = None  # int64 [b, Γ+1] the round in flight: cur, then the drafts
    indices: torch.Tensor | None = None  # int32 [b, k] its verification set
    verdict: torch.Tensor | None = None  # int64 [2, b] on the last stage, until every stage has it
    rounds: int = 0
    finish: phases.FinishCheck | None = None  # the stop rule, set when the slots begin
    verify_tokens: torch.Tensor | None = None  # the first stage: int64 [b, Γ+1], the forward's static input
    forward: CapturedStep | None = None  # this stage's forward, captured in a CUDA graph (CUDA only)
    # what this stage receives every round, allocated once (a micro-batch's next round starts only after its verdict,
    # by which time the previous round's messages have been read)
    inbox: dict[_Tag, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.slots.stop - self.slots.start

    @property
    def relaying(self) -> bool:
        """Whether a LongSpark payload goes round the stages (the drafter reads layers past the first stage)."""
        return self.relay is not None and self.relay.travels


class _Schedule:
    """Which micro-batch each stage works on, tick by tick, the same on every rank (module docstring)."""

    def __init__(self, stages: int, live: Sequence[int]) -> None:
        self.stages = [None] * stages  # micro-batch at each stage in the current tick
        self.ready = deque(live)  # micro-batches whose next round may start, oldest first

    @property
    def running(self) -> bool:
        return bool(self.ready) or any(m is not None for m in self.stages)

    def finished(self) -> int | None:
        """The micro-batch whose verdict the last stage reached in the tick that just ended."""
        return self.stages[-1]

    def advance(self) -> list[int | None]:
        self.stages = [self.ready.popleft() if self.ready else None] + self.stages[:-1]
        return self.stages


class _DtypeOf:
    def __init__(self, dtype: torch.dtype) -> None:
        self.weight = torch.empty(0, dtype=dtype)


class _ChunkThroughStage:
    """The pipeline as `PrefillJob`'s model: each prompt chunk enters the first stage as tokens, passes stage to stage
    as hidden states, and leaves the last stage as the logits of each prompt's last token in the chunk (zeros on the
    other stages, which have no logits)."""

    def __init__(self, stage: PipelineStage, group: PipelineGroup, rows: int) -> None:
        self.stage, self.group, self.config = stage, group, stage.config
        dtype, device = next(stage.parameters()).dtype, next(stage.parameters()).device
        self.embed = _DtypeOf(dtype)  # PrefillJob reads the queries' dtype from model.embed.weight
        self._no_logits = torch.zeros(rows, stage.config.vocab_size, dtype=torch.float32, device=device)

    def __call__(self, tokens: torch.Tensor, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                 logit_index: torch.Tensor | None = None, capture: QueryCapture | None = None) -> torch.Tensor:
        stage, group = self.stage, self.group
        B, T = tokens.shape
        x = tokens if stage.first else group.recv(
            torch.empty(B, T, stage.config.hidden_size, dtype=self.embed.weight.dtype, device=tokens.device),
            stage.rank - 1, _Tag.PREFILL, "a prefill chunk")
        out = stage(x, cache, meta, backend, logit_index=logit_index if stage.last else None, capture=capture)
        if stage.last:
            return out
        group.send(out, stage.rank + 1, _Tag.PREFILL)
        return self._no_logits


class PipelineDecoder:
    """This rank's part of a pipeline-parallel decoder (module docstring). Every rank constructs it with its own
    PipelineSetup and calls `generate` with the same prompts and config; each returns the same result."""

    def __init__(self, setup: PipelineSetup, facts: Mapping[str, str] | None = None) -> None:
        self.setup, self.group, self.stage = setup, setup.group, setup.stage
        self.split = pipeline_method(setup.method)
        self.spec = METHODS[setup.method]
        self.group.handshake({**setup.facts(), **(facts or {})})  # before anything is allocated
        stage, device = self.stage, self.group.device
        self.device = device
        self.gamma = setup.speculative_gamma
        self.dtype = next(stage.parameters()).dtype
        self.kv_dtype = setup.kv_dtype or self.dtype
        self.owner = {layer: rank for rank, (start, stop) in enumerate(setup.stage_layers)
                      for layer in range(start, stop)}  # global layer -> the rank that holds it
        self.shared_vocab = setup.draft_config.vocab_size if self.spec.needs_draft else stage.config.vocab_size
        dustin = setup.dustin
        variant = self.split.dustin_variant
        # The SRH target layers whose S_target the first stage sums (config order); none without Dustin's split.
        self.srh_layers = tuple(lh.layer for lh in dustin.target_layers) \
            if variant is not None and self.split.reads_target(dustin) else ()
        # In-pass selection: the selection layers (global) and the rank whose stage seeds round 1's set.
        self.selection_layers = tuple(lh.layer for lh in dustin.selection_layers) if self.split.in_pass else ()
        self.seeder = self.owner[self.selection_layers[0]] if self.selection_layers else None
        stray = [lh.layer for lh in dustin.pool_layers if self.owner[lh.layer] != self.seeder] \
            if self.selection_layers else []
        if stray:
            raise ConfigError(f"pipeline: pooled layers {stray} of the Dustin config lie on another stage than the "
                              f"first selection layer {self.selection_layers[0]} (rank {self.seeder}), whose choice "
                              "sums their scores; split the layers so that one stage holds them, or drop pool_layers")
        # The set's size k, as the registry gives it (methods._budget, and Dustin's own budget).
        self.budget = (dustin.budget if dustin is not None else setup.draft_budget) if self.spec.sparse else None
        stage.kernels = setup.kernels
        self.acceptors = phases.Acceptors(setup.kernels.round_kernels)
        self._acceptor: Acceptor | None = None  # bench: the last stage's stated acceptance
        self._untimed = PhaseTimer(False, device)
        self._timer = self._untimed  # bench: this rank's phases
        sizes = [setup.batch_slots // setup.micro_batches + (m < setup.batch_slots % setup.micro_batches)
                 for m in range(setup.micro_batches)]
        starts = [sum(sizes[:m]) for m in range(len(sizes))]
        with torch.inference_mode():
            self.micro = [self._allocate(slice(a, a + n)) for a, n in zip(starts, sizes, strict=True)]

    def _allocate(self, slots: slice) -> _MicroBatch:
        setup, stage = self.setup, self.stage
        b = slots.stop - slots.start
        cache = stage.allocate_cache(b, setup.max_seq_len, self.kv_dtype, self.device)
        state = RoundState.allocate(cache.seqlens)
        history, queries = None, {}
        if any(stage.owns(layer) for layer in self.srh_layers):
            history = TargetHistory(setup.dustin, stage, cache, pdl=setup.kernels.pdl)
            c = stage.config
            queries = {layer: torch.zeros(b, self.gamma + 1, c.num_heads, c.head_dim, dtype=self.dtype,
                                          device=self.device) for layer in history.layers}
        relay = LongSparkRelay(setup.longspark_config.target_layers, self.owner, stage, cache, self.gamma, self.dtype) \
            if self.spec.needs_longspark else None
        hidden = relay.hidden_capture if relay is not None else {}
        capture = QueryCapture(tuple(queries), queries, hidden) if queries or hidden else None
        mb = _MicroBatch(slots, cache, state, capture, history, relay=relay)
        owned = [lh for lh in setup.dustin.selection_layers if stage.owns(lh.layer)] if self.selection_layers else []
        if owned and not stage.first:  # the first stage's own selector (the registry's) chooses there
            pool = setup.dustin.pool_layers if owned[0].layer == self.selection_layers[0] else ()
            local = replace(setup.dustin, selection_layers=tuple(LayerHeads(lh.layer - stage.start, lh.heads)
                                                                 for lh in owned), selection_m=0, dense_layers=0,
                            pool_layers=tuple(LayerHeads(lh.layer - stage.start, lh.heads) for lh in pool))
            mb.chooser = InPassSelector(local, cache, stage.config, None, pdl=setup.kernels.pdl)
        g1, long = self.gamma + 1, torch.long
        if not stage.first:
            mb.inbox[_Tag.HIDDEN] = torch.zeros(b, g1, stage.config.hidden_size, dtype=self.dtype, device=self.device)
            mb.inbox[_Tag.TOKENS] = torch.zeros(b, g1, dtype=long, device=self.device)
            if self.budget is not None:  # a chooser rewrites the received set in place, in its own buffer
                mb.inbox[_Tag.INDICES] = mb.chooser.indices if mb.chooser is not None else \
                    torch.empty(b, self.budget, dtype=torch.int32, device=self.device)
        elif self.selection_layers:
            mb.inbox[_Tag.CHOSEN] = torch.empty(b, self.budget, dtype=torch.int32, device=self.device)
        if stage.first:
            mb.verify_tokens = torch.zeros(b, g1, dtype=long, device=self.device)
        if not stage.last:
            mb.inbox[_Tag.VERDICT] = torch.empty(2, b, dtype=long, device=self.device)
        elif self.gamma:  # rejection sampling's q (read only by sampled rounds)
            mb.inbox[_Tag.PROBS] = torch.empty(b, self.gamma, stage.config.vocab_size, dtype=torch.float32,
                                               device=self.device)
        if stage.first:
            dustin = setup.dustin
            if dustin is not None and self.split.dustin_variant is not None:
                dustin = self.split.first_stage_config(
                    dustin, setup.longspark_config.target_layers if self.split.longspark else ())
            decoder = build_runtime(setup.method, stage, draft=setup.draft, dustin=dustin, target_cache=cache,
                                    draft_kv_dtype=setup.draft_kv_dtype, kernels=setup.kernels,
                                    backend=setup.backend, gamma=setup.gamma, draft_budget=setup.draft_budget,
                                    use_cuda_graph=setup.use_cuda_graph, longspark=setup.longspark,
                                    longspark_kv=relay.kv_views() if relay is not None else None)
            if decoder.gamma != self.gamma or decoder.selector.budget != self.budget:
                raise RuntimeError(f"{setup.method}: the registry built gamma {decoder.gamma}, k "
                                   f"{decoder.selector.budget}; the pipeline expected {self.gamma}, {self.budget}")
            mb.drafter, mb.selector = decoder.drafter, decoder.selector
            mb.s_target = {layer: torch.zeros(b, setup.max_seq_len, dtype=torch.float32, device=self.device)
                           for layer in self.srh_layers if not stage.owns(layer)}
            mb.s_target_sum = torch.zeros(b, setup.max_seq_len, dtype=torch.float32, device=self.device)
        return mb

    # ---- a static batch ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig, per_slot_sampling: bool | None
                 = None) -> GenerationResult:
        """Decode every prompt (slots 0 .. n-1) to EOS or max_new_tokens, on every rank; each returns the tokens.

        Sampling: per_slot_sampling False (the default with one micro-batch) is Decoder.generate's, one generator for
        the batch (seed + 1 for the first token, seed for the rounds); True (required with micro-batches) gives slot
        b its own, seeded seed + b (seed + b + 1 for its first token), as `Decoder.generate([prompt_b])` with that
        seed samples. In the result, rounds are the most any micro-batch ran and the decode time runs from the moment
        every stage is ready (after the prefill, the first tokens and a warm-up) to the last verdict."""
        setup = self.setup
        per_slot = setup.micro_batches > 1 if per_slot_sampling is None else per_slot_sampling
        if setup.micro_batches > 1 and not per_slot:
            raise ConfigError("one generator for the whole batch cannot be shared by micro-batches in flight; sample "
                              "per slot or run --micro-batches 1")
        check_lengths(prompts, setup.batch_slots, setup.max_seq_len, config.max_new_tokens, lookahead=self.gamma)
        chunk = config.prefill_chunk or prefill_chunk_for(len(prompts))
        t0 = time.perf_counter()
        logits = {}
        for m, mb in enumerate(self.micro):  # the chunks of all micro-batches flow through the stages back to back
            mb.state.idle(slice(None))
            mine = [list(p) for p in prompts[mb.slots.start: mb.slots.stop]]
            mb.prompts, mb.rounds, mb.verdict = len(mine), 0, None
            mb.progress = Progress.allocate(mb.size, config.max_new_tokens, self.gamma, config.eos_token_ids,
                                            self.device)
            mb.sampling = self._round_sampling(mb, config, per_slot) if self.stage.first or self.stage.last else None
            if mine:
                logits[m] = self._prefill(mb, mine, chunk)
        live = []
        for m, mb in enumerate(self.micro):
            if mb.prompts:
                self._begin(mb, prompts[mb.slots.start: mb.slots.start + mb.prompts], logits[m], config, per_slot)
                if bool(mb.progress.active.any()):
                    live.append(m)
        self._warm_up(self.micro[0])
        self.group.barrier()  # the decode clock starts when every stage is ready
        t1 = time.perf_counter()
        self._decode(live, config.max_new_tokens)
        t2 = time.perf_counter()
        tokens = [row for mb in self.micro if mb.prompts for row in mb.progress.tokens(mb.prompts)]
        hist = sum(mb.progress.hist for mb in self.micro).tolist()
        rounds = max((mb.rounds for mb in self.micro), default=0)
        decode_ms = (t2 - t1) * 1e3
        return GenerationResult(tokens=tokens, prefill_ms=(t1 - t0) * 1e3, setup_ms=0.0, decode_ms=decode_ms,
                                rounds=rounds, decoding_rounds=rounds, decoding_ms=decode_ms, committed_hist=hist)

    def _decode(self, live: Sequence[int], limit: int) -> None:
        """The rounds of the live micro-batches, on the schedule (module docstring), until each stops: every slot
        finished, or `limit` rounds run."""
        for m in live:
            self._score_history(self.micro[m])
        schedule = _Schedule(self.group.world, live)
        while schedule.running:
            done = schedule.finished()
            if done is not None and self._consume(self.micro[done], limit):
                schedule.ready.append(done)
            working = schedule.advance()[self.group.rank]
            if working is not None:
                self._work(self.micro[working])
        self.group.drain()

    # ---- benchmarks ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def bench(self, context: int, rounds: int, acceptor: Acceptor | None = None, timer: PhaseTimer | None = None,
              seed: int = 0) -> PipelineBench:
        """Speed with random weights, on every rank: each slot as if a `context`-token prompt had just been
        prefilled (the caches hold whatever they hold, and no prefill runs; the hooks read zero queries), then
        `rounds` greedy rounds of every micro-batch on the schedule. acceptor: the last stage's verdict (a stated
        acceptance; None: greedy); timer: this rank's phases (module docstring). Every rank draws the same first
        tokens from `seed`. Returns this rank's wall time from the moment every stage is ready to its last commit."""
        setup, g1 = self.setup, self.gamma + 1
        width = rounds * g1 + 1  # the first token, then up to Γ + 1 a round: no slot reaches its limit
        if context < 1 or rounds < 1 or context + width + self.gamma > setup.max_seq_len:
            raise ConfigError(f"bench: context {context} + {rounds} rounds of up to {g1} tokens (+ {self.gamma}) "
                              f"must fit the cache's {setup.max_seq_len} positions per slot; lower them or raise "
                              "max_seq_len")
        first = torch.randint(0, self.shared_vocab, (setup.batch_slots,), generator=torch.Generator().manual_seed(
            seed)).to(self.device)
        config = self.stage.config
        for mb in self.micro:
            n = mb.size
            mb.state.idle(slice(None))
            mb.prompts, mb.rounds, mb.verdict = n, 0, None
            mb.progress = Progress.allocate(n, width, self.gamma, (), self.device)
            mb.sampling = SlotSampling.batch(GenerationConfig().sampling, n, self.device,
                                             use_kernel=setup.kernels.round_kernels)
            prompts = [[int(t)] * context for t in first[mb.slots].tolist()]
            mb.state.lengths[:n] = context
            queries = {layer: torch.zeros(n, config.num_heads, config.head_dim, dtype=self.dtype, device=self.device)
                       for layer in self._prefill_query_layers(mb)}
            hidden_out = mb.relay.prefill_hidden_out(n) if mb.relay is not None else {}
            self._prefilled(mb, prompts, queries, hidden_out, chunk=None)
            phases.begin(mb.state, mb.progress, slice(0, n), first[mb.slots], prompts, width)
            mb.finish = phases.FinishCheck(self.device, GenerationConfig().sync_every, poll=False)
        self._acceptor, self._timer = acceptor, timer or self._untimed
        try:
            self._warm_up(self.micro[0])
            _sync(self.device)
            self.group.barrier()
            t1 = time.perf_counter()
            self._decode(range(len(self.micro)), rounds)
            _sync(self.device)
            t2 = time.perf_counter()
        finally:
            self._acceptor, self._timer = None, self._untimed
        committed = sum(int(mb.progress.generated.sum()) for mb in self.micro)
        return PipelineBench(context=context, rounds=rounds, ms=(t2 - t1) * 1e3, committed=committed,
                             slots=setup.batch_slots)

    def _warm_up(self, mb: _MicroBatch) -> None:
        """The round's custom ops once, on copies, before the decode clock starts: a process's first one pays a
        one-time setup (importing torch._dynamo, about 3 s on the CPU host), which would otherwise land in one
        rank's first round. Decoder.capture does the same for the GPU's eager kernels."""
        use_kernel = self.setup.kernels.round_kernels
        zeros = torch.zeros(mb.size, dtype=torch.long, device=self.device)
        phases.warm_up_commit(torch.zeros(mb.size, self.gamma + 1, dtype=torch.long, device=self.device),
                              Verdict(zeros, zeros), mb.progress, mb.state, use_kernel)
        argmax_last(torch.zeros(mb.size, self.stage.config.vocab_size, device=self.device), use_kernel=use_kernel)

    def _round_sampling(self, mb: _MicroBatch, config: GenerationConfig, per_slot: bool) -> SlotSampling:
        use_kernel = self.setup.kernels.round_kernels
        if not per_slot:
            return SlotSampling.batch(config.sampling, mb.size, self.device, use_kernel=use_kernel)
        params = [replace(config.sampling, seed=config.sampling.seed + g) if g - mb.slots.start < mb.prompts else None
                  for g in range(mb.slots.start, mb.slots.stop)]
        generators = [torch.Generator(device=self.device).manual_seed(p.seed) if p is not None and not p.greedy
                      else None for p in params]
        return SlotSampling(params, generators, self.device, use_kernel)

    # ---- prefill and the first token ---------------------------------------------------------------------
    def _prefill(self, mb: _MicroBatch, prompts: list[list[int]], chunk: int) -> torch.Tensor:
        """The prompts through every stage (and the draft's cache on the first); the last stage's next-token logits
        [n, V] (zeros elsewhere); the SRH stages' target history and the first stage's hooks are set."""
        stage = self.stage
        model = _ChunkThroughStage(stage, self.group, len(prompts))
        layers = self._prefill_query_layers(mb)
        n = len(prompts)
        hidden_out = mb.relay.prefill_hidden_out(n) if mb.relay is not None else {}
        job = PrefillJob(model, mb.cache, self.setup.backend, prompts, chunk, capture_layers=layers,
                         hidden_out=hidden_out)
        logits, queries = job.run()
        self._prefilled(mb, prompts, dict(queries), hidden_out, chunk)
        return phases.mask_shared(logits, self.shared_vocab) if stage.last else logits

    def _prefill_query_layers(self, mb: _MicroBatch) -> tuple[int, ...]:
        """The global layers whose last prompt query this stage keeps: its SRH layers, and the first selection layer
        on the stage that seeds round 1's in-pass set."""
        owned = tuple(layer for layer in self.selection_layers[:1] if self.stage.owns(layer))
        return tuple(sorted({*(mb.history.layers if mb.history is not None else ()), *owned}))

    def _prefilled(self, mb: _MicroBatch, prompts: list[list[int]], queries: dict[int, torch.Tensor],
                   hidden_out: dict[int, torch.Tensor], chunk: int | None) -> None:
        """The prompts are in this stage's cache: the lengths, the LongSpark payload, the SRH history, round 1's
        in-pass set and the first stage's hooks (after the draft's own prefill; chunk None: the draft's cache already
        holds what it holds, as a benchmark's random caches do)."""
        stage, n = self.stage, len(prompts)
        owned = tuple(layer for layer in self.selection_layers[:1] if stage.owns(layer))
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device)
        hidden = self._relay_prefill(mb, hidden_out, max(len(p) for p in prompts)) if mb.relay is not None else {}
        view = PrefillView(slice(0, n), prompts, lengths, queries, hidden)
        if mb.history is not None:
            mb.history.on_prefill(view)
        if mb.chooser is not None and self.seeder == stage.rank:  # round 1's set: chosen here, sent to the first
            mb.chooser.on_prefill(replace(view, queries={owned[0] - stage.start: queries[owned[0]]}))
            self.group.send(mb.chooser.indices[:n].clone(), 0, _Tag.SEED)
        if stage.first:
            draft_job = mb.drafter.prefill(slice(0, n), prompts, chunk) if chunk is not None else None
            if draft_job is not None:
                draft_job.run()
            hooks = replace(view, queries={})  # the first stage's drafter and selector read no target query
            mb.drafter.on_prefill(hooks)
            if not self.selection_layers:
                mb.selector.on_prefill(hooks)
            elif self.seeder == 0:  # it owns the first selection layer: its selector seeds the set itself
                mb.selector.on_prefill(view)
            else:
                mb.selector.indices[:n] = self.group.recv(torch.empty(n, self.budget, dtype=torch.int32,
                                                                      device=self.device), self.seeder, _Tag.SEED,
                                                          "round 1's in-pass set")

    def _relay_prefill(self, mb: _MicroBatch, hidden_out: dict[int, torch.Tensor], longest: int
                       ) -> dict[int, torch.Tensor]:
        """A LongSpark draft's prefill payload round the stages (pipeline/longspark.py); on the first stage the read
        layers' last prompt hidden states [n, H] (nothing elsewhere)."""
        relay, group, rank = mb.relay, self.group, self.stage.rank
        if not relay.travels:
            return dict(hidden_out)
        kv, hidden = relay.prefill_payload(mb.prompts, longest)
        if rank == 0:
            group.recv(kv, group.world - 1, _Tag.LS_KV, "the LongSpark layers' prompt K/V")
            group.recv(hidden, group.world - 1, _Tag.LS_HIDDEN, "the LongSpark layers' prompt hidden states")
            return relay.unpack_prefill(kv, hidden, hidden_out)
        if rank >= 2:
            group.recv(kv, rank - 1, _Tag.LS_KV, "the LongSpark layers' prompt K/V")
            group.recv(hidden, rank - 1, _Tag.LS_HIDDEN, "the LongSpark layers' prompt hidden states")
        relay.pack_prefill(kv, hidden, hidden_out)
        to = 0 if self.stage.last else rank + 1
        group.send(kv, to, _Tag.LS_KV)
        group.send(hidden, to, _Tag.LS_HIDDEN)
        return {}

    def _begin(self, mb: _MicroBatch, prompts: Sequence[Sequence[int]], logits: torch.Tensor,
               config: GenerationConfig, per_slot: bool) -> None:
        """The first token of each prompt, picked on the last stage (as Decoder.generate or in-flight serving picks
        it) and sent to every stage; the slots begin."""
        n, use_kernel = mb.prompts, self.setup.kernels.round_kernels
        first = torch.empty(n, dtype=torch.long, device=self.device)
        if self.stage.last:
            sampling = [replace(config.sampling, seed=config.sampling.seed + g)
                        for g in range(mb.slots.start, mb.slots.start + n)] if per_slot else config.sampling
            first = phases.first_tokens(logits, sampling, use_kernel)
            for rank in range(self.group.world - 1):
                self.group.send(first, rank, _Tag.FIRST)
        else:
            self.group.recv(first, self.group.world - 1, _Tag.FIRST, "the first tokens")
        phases.begin(mb.state, mb.progress, slice(0, n), first, prompts, config.max_new_tokens)
        mb.finish = phases.FinishCheck(self.device, config.sync_every, poll=False)  # every rank stops alike

    # ---- one round, in two halves: a stage's work, then every stage's commit of the verdict ---------------
    def _work(self, mb: _MicroBatch) -> None:
        """This stage's part of the micro-batch's round (module docstring)."""
        stage, group, phase = self.stage, self.group, self._timer
        sampled = not (mb.sampling is None or mb.sampling.all_greedy)
        if stage.first:
            with phase("draft"):
                proposal = mb.drafter.propose(mb.state, mb.sampling)  # tokens [b, Γ]
                mb.verify_tokens[:, 0] = mb.state.cur
                mb.verify_tokens[:, 1:] = proposal.tokens
                mb.tokens = x = mb.verify_tokens  # [b, Γ+1]
            with phase("select"):  # with S_target from the SRH stages
                mb.indices = self._select(mb)  # [b, k] or None: what every stage's verification reads
        else:
            src, inbox = stage.rank - 1, mb.inbox
            with phase("wait"):
                x = group.recv(inbox[_Tag.HIDDEN], src, _Tag.HIDDEN, "the verification's hidden states")
                mb.tokens = group.recv(inbox[_Tag.TOKENS], src, _Tag.TOKENS, "the round's tokens")
                if self.budget is not None:
                    mb.indices = group.recv(inbox[_Tag.INDICES], src, _Tag.INDICES, "the verification set")
                if mb.relaying and stage.rank >= 2:  # the first stage sends no payload
                    group.recv(mb.relay.kv, src, _Tag.LS_KV, "the LongSpark layers' K/V rows")
                    group.recv(mb.relay.hidden, src, _Tag.LS_HIDDEN, "the LongSpark layers' hidden states")
        with phase("forward"):
            out = self._forward(mb, x)  # hidden [b, Γ+1, H] or logits
        with phase("send") if not stage.last else phase("accept"):
            self._after_forward(mb, out, sampled, proposal if stage.first else None)

    def _forward(self, mb: _MicroBatch, x: torch.Tensor) -> torch.Tensor:
        """This stage's layers over the round's Γ + 1 tokens; on CUDA (use_cuda_graph) one CUDA graph per micro-batch,
        captured at its first round (a CapturedStep: inputs in other buffers than the captured ones are copied in)."""
        in_pass = (mb.selector.in_pass if self.stage.first else mb.chooser) if self.selection_layers else None
        graphed = self.setup.use_cuda_graph and self.device.type == "cuda"
        if mb.forward is None or not graphed:
            def run(x: torch.Tensor, lengths: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
                meta = AttentionMetadata(cache_seqlens=lengths, indices=indices[0] if indices else None,
                                         in_pass=in_pass)
                return self.stage(x, mb.cache, meta, self.setup.backend, capture=mb.capture)

            if not graphed:
                return run(x, mb.state.lengths, *(() if mb.indices is None else (mb.indices,)))
            # The pass rewrites an in-pass set in place: the warm-up runs put it back (the replay starts from it).
            chosen = (in_pass.indices,) if isinstance(in_pass, InPassSelector) else ()
            mb.forward = CapturedStep(run, x, mb.state.lengths, *(() if mb.indices is None else (mb.indices,)),
                                      restore=chosen)
        return mb.forward(x, mb.state.lengths, *(() if mb.indices is None else (mb.indices,)))

    def _after_forward(self, mb: _MicroBatch, out: torch.Tensor, sampled: bool, proposal: Proposal | None) -> None:
        """The stage's messages after its forward: the next stage's inputs, or (the last stage) the verdict."""
        stage, group = self.stage, self.group
        relayed = mb.relaying and not stage.first
        if relayed:
            mb.relay.pack_round(mb.state.lengths)
        if stage.last:
            self._accept(mb, out, sampled)
            if relayed:  # after the verdict's messages: the first stage receives in this order
                group.send(mb.relay.kv.clone(), 0, _Tag.LS_KV)
                group.send(mb.relay.hidden.clone(), 0, _Tag.LS_HIDDEN)
            return
        group.send(out, stage.rank + 1, _Tag.HIDDEN)
        group.send(mb.tokens.clone(), stage.rank + 1, _Tag.TOKENS)
        if mb.indices is not None:
            group.send(mb.indices.clone(), stage.rank + 1, _Tag.INDICES)
        if relayed:
            group.send(mb.relay.kv.clone(), stage.rank + 1, _Tag.LS_KV)
            group.send(mb.relay.hidden.clone(), stage.rank + 1, _Tag.LS_HIDDEN)
        if stage.first and sampled:  # after the forward's messages: the last stage receives in this order
            last = group.world - 1
            if self.gamma:
                group.send(proposal.probs.clone(), last, _Tag.PROBS)
            group.send(_generator_states(mb.sampling), last, _Tag.STATES)

    def _select(self, mb: _MicroBatch) -> torch.Tensor | None:
        """The first stage's estimate and select; Dustin's S_target comes summed from the SRH stages."""
        def with_s_target(scores: tuple) -> tuple:
            for layer in self.srh_layers:
                if not self.stage.owns(layer):
                    self.group.recv(mb.s_target[layer], self.owner[layer], _Tag.S_TARGET, f"S_target of layer {layer}")
            return scores[0], sum_in_order(self.srh_layers, mb.s_target, mb.s_target_sum)

        return phases.choose(mb.selector, mb.state.lengths, combine=with_s_target if self.srh_layers else None)

    def _accept(self, mb: _MicroBatch, logits: torch.Tensor, sampled: bool) -> None:
        """The last stage: the verdict from the logits [b, Γ+1, V], sent to every other stage."""
        group, b = self.group, mb.size
        phases.mask_shared(logits, self.shared_vocab)
        probs = None
        if sampled:
            probs = mb.inbox[_Tag.PROBS] if self.gamma else logits.new_zeros(b, 0, logits.shape[-1])
            if self.gamma:
                group.recv(probs, 0, _Tag.PROBS, "the draft's distributions")
            states = group.recv(torch.empty_like(_generator_states(mb.sampling)), 0, _Tag.STATES,
                                "the sampling generator state")
            _set_generator_states(mb.sampling, states)
        verdict = phases.accept(self.acceptors, Proposal(mb.tokens[:, 1:], probs), logits, mb.progress, mb.sampling,
                                self._acceptor)
        mb.verdict = torch.stack([verdict.accepted, verdict.next_tokens])  # [2, b]
        for rank in range(group.world - 1):
            group.send(mb.verdict, rank, _Tag.VERDICT)
        if self.selection_layers:  # the first stage's next pre-pass and sparse draft start from the pass's choice
            group.send(mb.indices.clone(), 0, _Tag.CHOSEN)
        if sampled:
            group.send(_generator_states(mb.sampling), 0, _Tag.STATES)

    def _consume(self, mb: _MicroBatch, limit: int) -> bool:
        """Every stage: the micro-batch's verdict observed and committed; whether its next round runs (decided from
        the Progress, which every stage holds identically)."""
        stage, group, phase = self.stage, self.group, self._timer
        with phase("wait"):
            if not stage.last:
                mb.verdict = group.recv(mb.inbox[_Tag.VERDICT], group.world - 1, _Tag.VERDICT, "the verdict")
                if stage.first and self.selection_layers:  # mb.indices is the selector's buffer: both take the choice
                    mb.indices.copy_(group.recv(mb.inbox[_Tag.CHOSEN], group.world - 1, _Tag.CHOSEN,
                                                "the set the pass chose"))
                if stage.first and not mb.sampling.all_greedy:
                    states = group.recv(torch.empty_like(_generator_states(mb.sampling)), group.world - 1, _Tag.STATES,
                                        "the sampling generator state")
                    _set_generator_states(mb.sampling, states)
                if stage.first and mb.relaying:  # before the drafter observes the round
                    group.recv(mb.relay.kv, group.world - 1, _Tag.LS_KV, "the LongSpark layers' K/V rows")
                    group.recv(mb.relay.hidden, group.world - 1, _Tag.LS_HIDDEN, "the LongSpark layers' hidden states")
                    mb.relay.unpack_round(mb.state.lengths)
        with phase("commit"):
            observers = [mb.drafter, mb.selector] if stage.first else []  # the order of Decoder.round
            if mb.history is not None:
                observers.append(mb.history)
            phases.observe_and_commit(mb.tokens, Verdict(mb.verdict[0], mb.verdict[1]), mb.progress, mb.state,
                                      mb.indices, mb.capture.queries if mb.capture is not None else {},
                                      mb.relay.verify_hidden if mb.relay is not None else {}, observers,
                                      self.setup.kernels.round_kernels)
        mb.rounds += 1
        # Decoder.generate's stop rule, without polling: every stage decides after the same round.
        going = mb.rounds < limit and not mb.finish(mb.progress.active, mb.rounds)
        if going:
            with phase("history"):
                self._score_history(mb)
        return going

    def _score_history(self, mb: _MicroBatch) -> None:
        """An SRH stage: S_target of the micro-batch's next round, each owned layer's -> the first stage."""
        if mb.history is None or not self.srh_layers:
            return
        scores = mb.history.scores(mb.state.lengths)
        for layer, score in zip(mb.history.layers, scores, strict=True):
            if self.stage.first:
                mb.s_target[layer] = score  # the part's own buffer: read by this round's select
            else:
                self.group.send(score.clone(), 0, _Tag.S_TARGET)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generator_states(sampling: SlotSampling) -> torch.Tensor:
    """uint8 [n, S]: the state of the batch's generator (n = 1) or of each sampled slot's, in slot order."""
    generators = [sampling.generators] if sampling.shared else [g for g in sampling.generators if g is not None]
    return torch.stack([g.get_state() for g in generators]).to(sampling.device)  # NCCL sends device tensors


def _set_generator_states(sampling: SlotSampling, states: torch.Tensor) -> None:
    generators = [sampling.generators] if sampling.shared else [g for g in sampling.generators if g is not None]
    for g, state in zip(generators, states.cpu(), strict=True):
        g.set_state(state.clone())
