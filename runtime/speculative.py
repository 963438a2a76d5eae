"""Batched speculative decoding: the round that Classic SD, MagicDec and Dustin share.

    prefill -> [draft -> estimate -> select -> verify -> accept -> commit] per round

State between rounds, per sequence b: the target cache holds the committed tokens [0, L_b); `cur`
(the last committed token, position L_b) is in neither cache yet; `prev` is the token at L_b - 1.
The draft's first step processes (prev, cur) at (L_b - 1, L_b): rewriting prev is a no-op when the
draft already has it and fills the gap when the previous round accepted all Γ tokens (the draft never
processed its own last token). Rejected cache positions are simply overwritten by later rounds.

Methods differ only in the hooks: how the draft attends (`draft_metadata`), whether and how the
verification set is chosen (`estimate`, `select`), and what they keep from a round (`after_commit`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.plugins.commit import commit_round
from trtllm_dustin.runtime.acceptance import greedy_accept_ids, rejection_accept
from trtllm_dustin.runtime.cuda_graph import CapturedStep
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.prefill import prefill, slot_view
from trtllm_dustin.runtime.sampling import sample, sampling_probs
from trtllm_dustin.runtime.vanilla import GenerationConfig, GenerationResult, check_request

__all__ = ["DecodeState", "SpeculativeDecoder", "SpeculativeResult"]


@dataclass
class DecodeState:
    """What the round loop carries between rounds, all on the device."""

    out: torch.Tensor  # [B, max_new + 1] generated ids (-1 = none); the last column takes masked writes
    active: torch.Tensor  # bool [B]: still generating
    generated: torch.Tensor  # int64 [B]: tokens generated so far
    hist: torch.Tensor  # int64 [Γ+1]: sequence-rounds by accepted count
    eos: torch.Tensor  # ids that end a sequence
    generator: torch.Generator  # sampling randomness of this run


@dataclass
class SpeculativeResult(GenerationResult):
    rounds: int = 0
    committed_hist: list[int] = field(default_factory=list)  # [n] = sequence-rounds that committed n+1 tokens
    phase_ms: dict[str, float] = field(default_factory=dict)  # filled by a profiling run (profile=True)

    @property
    def tau(self) -> float:
        """Mean tokens committed per sequence per round (accepted draft tokens + 1), 1 <= tau <= Γ+1."""
        rounds = sum(self.committed_hist)
        return sum((n + 1) * c for n, c in enumerate(self.committed_hist)) / rounds if rounds else float("nan")


class SpeculativeDecoder:
    """Draft Γ tokens with a small model, verify them with the target in one forward, commit the agreed prefix."""

    name = "speculative"
    target_capture_layers: tuple[int, ...] = ()  # target layers whose prompt-end queries prefill keeps

    def __init__(self, target: Transformer, draft: Transformer, target_cache: KVCache, draft_cache: KVCache,
                 backend: AttentionBackend, gamma: int = 3, use_cuda_graph: bool = True) -> None:
        if gamma < 1:
            raise ValueError(f"gamma={gamma} must be >= 1")
        if draft.config.vocab_size > target.config.vocab_size:
            raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) is larger than the target's "
                             f"({target.config.vocab_size}); the pair must share a tokenizer")
        # Pairs may pad their embedding tables differently (Qwen2.5-0.5B: 151936 rows, 7B: 152064) around one
        # tokenizer: the target only ever proposes ids of the shared vocabulary, which every real token is in.
        self.shared_vocab = draft.config.vocab_size
        if (target_cache.batch_slots, target_cache.max_seq_len) != (draft_cache.batch_slots, draft_cache.max_seq_len):
            raise ValueError("target and draft caches must have the same batch slots and max_seq_len")
        self.target, self.draft, self.backend, self.gamma = target, draft, backend, gamma
        self.tcache, self.dcache = target_cache, draft_cache
        self.device = target_cache.seqlens.device
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        B, V = target_cache.batch_slots, target.config.vocab_size
        self.cur = torch.zeros(B, dtype=torch.long, device=self.device)
        self.prev = torch.zeros(B, dtype=torch.long, device=self.device)
        self.draft_tokens = torch.zeros(B, gamma, dtype=torch.long, device=self.device)
        self.draft_probs = torch.zeros(B, gamma, V, dtype=torch.float32, device=self.device)
        self.verify_tokens = torch.zeros(B, gamma + 1, dtype=torch.long, device=self.device)
        self.positions = torch.arange(gamma + 1, device=self.device)  # offsets of a round's Γ+1 tokens
        self.rows = torch.arange(B, device=self.device)  # batch-slot index, for per-slot gathers
        self.indices: torch.Tensor | None = None  # int32 [B, k] verification set, for sparse methods
        # Benchmarks with random weights only: P(accepted = n), n = 0..Γ. Verification still runs in full; only its
        # verdict is replaced by a draw from this stated distribution (random weights accept nothing useful).
        self.forced_acceptance: torch.Tensor | None = None
        self._graphs: dict[str, CapturedStep] = {}

    # ---- hooks -------------------------------------------------------------------------------------------
    def draft_metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        """How the draft attends when its new tokens start at position `lens` (Classic SD: the full cache)."""
        return AttentionMetadata(cache_seqlens=lens)

    def draft_capture(self, step: int) -> QueryCapture | None:
        return None

    def verify_capture(self) -> QueryCapture | None:
        return None

    def estimate(self) -> None:
        """Score the committed context for sparse verification (Dustin: Eq. 5 on the SRHs)."""

    def select(self) -> None:
        """Fill self.indices, the verification set (Dustin: Eq. 6)."""

    def after_prefill(self, last_queries: dict[int, torch.Tensor], batch: int) -> None:
        """Keep what prefill measured (Dustin: the prompt end's target queries)."""

    def after_commit(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """Keep what this round measured (Dustin: the last accepted token's target queries)."""

    # ---- one round ---------------------------------------------------------------------------------------
    def _run(self, name: str, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """Run a fixed-shape phase eagerly, or from its CUDA graph (captured on first use)."""
        if not self.use_cuda_graph:
            return fn()
        if name not in self._graphs:
            self._graphs[name] = CapturedStep(fn)
        return self._graphs[name]()

    def _draft_forward(self, step: int) -> torch.Tensor:
        L = self.tcache.seqlens
        if step == 0:
            tokens, lens = torch.stack([self.prev, self.cur], dim=1), L - 1  # [B, 2] at L-1, L
        else:
            tokens, lens = self.draft_tokens[:, step - 1: step], L + step  # [B, 1] at L+step
        last = torch.full_like(L, tokens.shape[1] - 1, dtype=torch.long)
        return self.draft(tokens, self.dcache, self.draft_metadata(lens), self.backend, logit_index=last,
                          capture=self.draft_capture(step))  # [B, V]

    def _draft_greedy(self, step: int) -> torch.Tensor:
        """A greedy draft step that also writes its token, so the pick is inside the step's CUDA graph."""
        logits = self._draft_forward(step)
        self.draft_tokens[:, step] = argmax_last(logits)
        return logits

    def _run_draft(self, step: int, greedy: bool) -> torch.Tensor:
        if greedy:
            return self._run(f"draft{step}-greedy", lambda: self._draft_greedy(step))
        return self._run(f"draft{step}", lambda: self._draft_forward(step))

    def draft_tokens_for_round(self, config: GenerationConfig, generator: torch.Generator) -> None:
        for step in range(self.gamma):
            logits = self._run_draft(step, config.sampling.greedy)
            if not config.sampling.greedy:  # ids past the draft's vocabulary keep probability 0
                self.draft_tokens[:, step] = sample(logits, config.sampling, generator)
                self.draft_probs[:, step, : self.shared_vocab] = sampling_probs(logits, config.sampling)

    def _verify_forward(self) -> torch.Tensor:
        self.verify_tokens[:, 0] = self.cur
        self.verify_tokens[:, 1:] = self.draft_tokens
        meta = AttentionMetadata(cache_seqlens=self.tcache.seqlens, indices=self.indices)
        logits = self.target(self.verify_tokens, self.tcache, meta, self.backend,
                             capture=self.verify_capture())  # [B, Γ+1, V]
        return self._shared(logits)

    def _shared(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits with ids outside the pair's shared vocabulary masked out."""
        if self.shared_vocab < logits.shape[-1]:
            logits[..., self.shared_vocab:] = float("-inf")
        return logits

    # ---- the loop ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, first: torch.Tensor, prev: torch.Tensor, batch: int, config: GenerationConfig) -> DecodeState:
        """Round-loop state once the caches hold the prompts: `first` [batch] is the first generated token."""
        slots, device = self.tcache.batch_slots, self.device
        # Every round runs all slots so the captured shapes never change; slots past `batch` are inactive.
        state = DecodeState(
            out=torch.full((slots, config.max_new_tokens + 1), -1, dtype=torch.long, device=device),  # last: junk
            active=torch.arange(slots, device=device) < batch,
            generated=torch.zeros(slots, dtype=torch.long, device=device),
            hist=torch.zeros(self.gamma + 1, dtype=torch.long, device=device),
            eos=torch.tensor(config.eos_token_ids or (-1,), device=device),
            generator=torch.Generator(device=device).manual_seed(config.sampling.seed))
        self.cur.zero_()
        self.cur[:batch] = first
        self.prev.zero_()
        self.prev[:batch] = prev
        state.out[:, 0] = torch.where(state.active, self.cur, -1)
        state.generated += state.active.long()
        state.active &= ~torch.isin(self.cur, state.eos) & (state.generated < config.max_new_tokens)
        return state

    @torch.inference_mode()
    def capture_graphs(self, greedy: bool = True) -> None:
        """JIT and capture every phase before timing starts. Their side effects (draft/verify K/V at positions past
        the committed length, draft tokens, scores, indices) are all rewritten by the next real round before being
        read."""
        if not self.use_cuda_graph:
            return
        for step in range(self.gamma):
            self._run_draft(step, greedy)
        if self.indices is not None:
            self._run("estimate", self.estimate)
            self._run("select", self.select)
        self._run("verify", self._verify_forward)

    @torch.inference_mode()
    def round(self, state: DecodeState, config: GenerationConfig, timer: PhaseTimer) -> None:
        """draft -> estimate -> select -> verify -> accept -> commit, for every slot, without a host sync."""
        with timer("draft"):
            self.draft_tokens_for_round(config, state.generator)
        if self.indices is not None:  # sparse verification: choose what the target reads this round
            with timer("estimate"):
                self._run("estimate", self.estimate)
            with timer("select"):
                self._run("select", self.select)
        with timer("verify"):
            target_logits = self._run("verify", self._verify_forward)
        with timer("accept"):
            target_ids = None
            if config.sampling.greedy:
                target_ids = argmax_last(target_logits)  # [B, Γ+1]
                accepted, nxt = greedy_accept_ids(self.draft_tokens, target_ids)
            else:
                accepted, nxt = rejection_accept(self.draft_tokens, self.draft_probs, target_logits, config.sampling,
                                                 state.generator)
            if self.forced_acceptance is not None:
                accepted = torch.multinomial(self.forced_acceptance.expand(accepted.shape[0], -1), 1,
                                             generator=state.generator)[:, 0]
                if target_ids is None:
                    target_ids = argmax_last(target_logits)
                nxt = target_ids.gather(1, accepted[:, None])[:, 0]
            self.commit(state, accepted, nxt, config.max_new_tokens)

    def commit(self, state: DecodeState, accepted: torch.Tensor, nxt: torch.Tensor, max_new_tokens: int) -> None:
        """Append the accepted drafts and the target's token, cut at EOS and max_new_tokens; advance the caches."""
        self.after_commit(accepted, state.active)  # reads the round's verdict before the state moves on
        # In place, one launch on the GPU: the captured draft and verify steps read prev, cur and the seqlens.
        commit_round(self.draft_tokens, self.verify_tokens, accepted, nxt, state.eos, max_new_tokens, state.out,
                     state.active, state.generated, state.hist, self.prev, self.cur, self.tcache.seqlens,
                     self.dcache.seqlens)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig, profile: bool = False
                 ) -> SpeculativeResult:
        check_request(prompts, self.tcache, config.max_new_tokens, lookahead=self.gamma)
        B, device = len(prompts), self.device
        timer = PhaseTimer(profile, device)

        _sync(device)
        t0 = time.perf_counter()
        self.tcache.seqlens.zero_()
        logits, last_queries = prefill(self.target, self.tcache, self.backend, prompts, config.prefill_chunk,
                                       self.target_capture_layers)
        prefill(self.draft, slot_view(self.dcache, B), self.backend, prompts, config.prefill_chunk)
        self.tcache.seqlens[B:] = 1  # idle slots run along at position 1 (the draft's first step reads L - 1)
        self.dcache.seqlens.copy_(self.tcache.seqlens)
        self.after_prefill(last_queries, B)
        state = self.start(sample(self._shared(logits), config.sampling, torch.Generator(device=device).manual_seed(
            config.sampling.seed + 1)), torch.tensor([p[-1] for p in prompts], device=device), B, config)
        self.capture_graphs(config.sampling.greedy)  # one-time cost, kept out of the decode time
        _sync(device)
        t1 = time.perf_counter()

        rounds = 0
        for rounds in range(1, config.max_new_tokens + 1):  # every round commits >= 1 token per active sequence
            self.round(state, config, timer)
            # The one host sync of the loop, every sync_every rounds: stop once every sequence has finished.
            if rounds % config.sync_every == 0 and not bool(state.active.any()):
                break
        _sync(device)
        t2 = time.perf_counter()
        rows = state.out[:B, : config.max_new_tokens].tolist()
        return SpeculativeResult(
            tokens=[[t for t in row if t >= 0] for row in rows], prefill_ms=(t1 - t0) * 1e3,
            decode_ms=(t2 - t1) * 1e3, decode_steps=rounds, rounds=rounds, committed_hist=state.hist.tolist(),
            phase_ms=timer.totals_ms())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
