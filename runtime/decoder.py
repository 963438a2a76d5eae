"""The one decode loop: a target model verifies what a Drafter proposed, against what a Selector chose.

    prefill(slots) -> [draft -> estimate -> select -> verify -> accept -> commit] per round

Every caller runs this `Decoder.round`: `generate()` below (a static batch), the in-flight batcher (inflight.py:
requests join and leave slots between rounds), the quality evaluation (teacher-forced acceptor) and the
benchmarks (stated-distribution acceptor). A method is a (Drafter, Selector) pair (methods.py); vanilla decoding is
the pair (no draft, full verification), whose round verifies the last token alone and commits the target's next.

Every round runs all batch slots so the captured shapes never change; slots without a sequence are idle
(state.py). The round has no host sync: the drafter's steps, the estimate, the selection and the verification are
fixed-shape phases (CUDA graphs on the GPU) and the commit is one kernel.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.commit import commit_round
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.acceptor import Acceptor, Verdict
from trtllm_dustin.runtime.acceptors import GreedyAcceptor, RejectionAcceptor
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Drafter, PrefillView
from trtllm_dustin.runtime.generation import GenerationConfig, GenerationResult, check_request
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.prefill import prefill, slot_range
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation, Progress, RoundState

__all__ = ["Decoder"]


class Decoder:
    def __init__(self, name: str, target: Transformer, cache: KVCache, drafter: Drafter, selector: Selector,
                 backend: AttentionBackend, graphs: PhaseGraphs, kernels: KernelConfig, shared_vocab: int) -> None:
        self.name, self.target, self.cache, self.backend = name, target, cache, backend
        self.drafter, self.selector, self.graphs, self.kernels = drafter, selector, graphs, kernels
        self.gamma = drafter.gamma
        self.device = cache.seqlens.device
        # Pairs may pad their embedding tables differently (Qwen2.5-0.5B: 151936 rows, 7B: 152064) around one
        # tokenizer: the target only ever proposes ids of the shared vocabulary, which every real token is in.
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
        self._greedy = GreedyAcceptor(kernels.round_kernels)
        self._rejection = RejectionAcceptor(kernels.round_kernels)
        self._untimed = PhaseTimer(False, self.device)

    # ---- slots -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int = 2048) -> torch.Tensor:
        """Write the prompts into both caches at slots [start, stop), run the per-slot hooks, and return the
        target's logits of each prompt's next token [n, V] (ids outside the shared vocabulary masked)."""
        n, dtype = len(prompts), self.target.embed.weight.dtype
        hidden = {layer: torch.zeros(n, self.target.config.hidden_size, dtype=dtype, device=self.device)
                  for layer in self.target_hidden_layers}
        logits, queries = prefill(self.target, slot_range(self.cache, slots), self.backend, prompts, chunk,
                                  self.target_query_layers, hidden_out=hidden)
        self.drafter.prefill(slots, prompts, chunk)
        self.prefilled(slots, prompts, queries, hidden)
        return self.shared_logits(logits)

    @torch.inference_mode()
    def prefilled(self, slots: slice, prompts: Sequence[Sequence[int]], queries: dict[int, torch.Tensor],
                  hidden: dict[int, torch.Tensor] | None = None) -> None:
        """The caches already hold the prompts at slots [start, stop) (a prefill shared by several decoders):
        set the slots' lengths and run the drafter's and selector's prompt-time hooks. queries: target layer ->
        [n, H_q, D], the last prompt token's query, for at least the decoder's target_query_layers; hidden: target
        layer -> [n, H], its hidden state, for at least target_hidden_layers."""
        hidden = hidden or {}
        missing = [layer for layer in self.target_hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(f"{self.name} reads the target's hidden states at layers {missing}; the prefill given "
                             "kept none (pass hidden_out to prefill)")
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device)
        self.state.lengths[slots] = lengths
        view = PrefillView(slots, [list(p) for p in prompts], lengths,
                           {layer: queries[layer] for layer in self.target_query_layers},
                           {layer: hidden[layer] for layer in self.target_hidden_layers})
        self.drafter.on_prefill(view)
        self.selector.on_prefill(view)

    @torch.inference_mode()
    def begin(self, progress: Progress, slots: slice, first: torch.Tensor, prompts: Sequence[Sequence[int]],
              limits: int | Sequence[int]) -> None:
        """Slots start generating: `first` [n] is each one's first token (sampled from the prefill logits)."""
        self.state.cur[slots] = first
        self.state.prev[slots] = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=self.device)
        progress.begin(slots, first, limits)

    @torch.inference_mode()
    def release(self, progress: Progress, slot: int) -> None:
        """A slot stops (finished or cancelled) and runs along idle until its next admission."""
        progress.active[slot] = False
        self.state.idle(slice(slot, slot + 1))

    # ---- one round ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def round(self, progress: Progress, sampling: SlotSampling, acceptor: Acceptor | None = None,
              timer: PhaseTimer | None = None) -> Verdict:
        """draft -> estimate -> select -> verify -> accept -> commit, for every slot, without a host sync.
        acceptor: None picks greedy acceptance when every slot is greedy and rejection sampling otherwise."""
        phase = timer or self._untimed
        with phase("draft"):
            proposal = self.drafter.propose(self.state, sampling)  # tokens [B, Γ]
        indices = self._select(phase)  # sparse verification: what the target reads this round (None: all)
        with phase("verify"):
            logits = self.graphs.run("verify", partial(self._verify, proposal.tokens, indices))  # [B, Γ+1, V]
        with phase("accept"):
            acceptor = acceptor or (self._greedy if sampling.all_greedy else self._rejection)
            verdict = acceptor.accept(proposal, logits, progress, sampling)
            seen = Observation(verdict.accepted, verdict.next_tokens, progress.active, self.state.lengths, indices,
                               self.verify_queries, self.verify_hidden)
            self.drafter.observe(seen)  # both read the verdict before the commit moves the state on
            self.selector.observe(seen)
            self.commit(proposal.tokens, verdict, progress)
        return verdict

    def commit(self, draft_tokens: torch.Tensor, verdict: Verdict, progress: Progress) -> None:
        """Append the accepted drafts and the target's token, cut at EOS and each slot's limit; advance the state.
        In place, one launch on the GPU: the captured phases read prev, cur and the lengths."""
        state = self.state
        commit_round(draft_tokens, self.verify_tokens, verdict.accepted, verdict.next_tokens, progress.eos,
                     progress.limits, progress.out, progress.active, progress.generated, progress.hist, state.prev,
                     state.cur, state.lengths, use_kernel=self.kernels.round_kernels)

    def _select(self, phase: PhaseTimer) -> torch.Tensor | None:
        """The estimate and select phases: the round's verification set, or None when the selector verifies in
        full (no phases run)."""
        if self.selector.budget is None:
            return None
        with phase("estimate"):
            scores = self.graphs.run("estimate", partial(self.selector.estimate, self.state.lengths))
        with phase("select"):
            return self.graphs.run("select", partial(self.selector.select, self.state.lengths, scores))

    def _verify(self, draft_tokens: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        self.verify_tokens[:, 0] = self.state.cur
        self.verify_tokens[:, 1:] = draft_tokens
        meta = AttentionMetadata(cache_seqlens=self.state.lengths, indices=indices)
        logits = self.target(self.verify_tokens, self.cache, meta, self.backend, capture=self._capture)  # [B, Γ+1, V]
        return self.shared_logits(logits)

    def shared_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits with ids outside the pair's shared vocabulary masked out."""
        if self.shared_vocab < logits.shape[-1]:
            logits[..., self.shared_vocab:] = float("-inf")
        return logits

    @torch.inference_mode()
    def capture(self, greedy: bool = True) -> None:
        """JIT and capture every phase before timing starts. Their side effects (K/V at positions past the committed
        length, drafted tokens, scores, the set) are all rewritten by the next real round before being read; no
        randomness is drawn."""
        if not self.graphs.enabled:
            return
        proposal = self.drafter.capture(self.state, greedy)
        indices = self._select(self._untimed)
        self.graphs.run("verify", partial(self._verify, proposal.tokens, indices))

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
        logits = self.prefill(slice(0, B), prompts, config.prefill_chunk)
        first = SlotSampling.batch(config.sampling, B, device, seed=config.sampling.seed + 1,
                                   use_kernel=use_kernel).pick(logits)
        self.begin(progress, slice(0, B), first, prompts, config.max_new_tokens)
        self.capture(sampling.all_greedy)  # one-time cost, kept out of the decode time
        _sync(device)
        t1 = time.perf_counter()

        rounds = 0
        if bool(progress.active.any()):
            for rounds in range(1, config.max_new_tokens + 1):  # every round commits >= 1 token per active slot
                self.round(progress, sampling, timer=timer)
                # The one host sync of the loop, every sync_every rounds: stop once every sequence has finished.
                if rounds % config.sync_every == 0 and not bool(progress.active.any()):
                    break
        _sync(device)
        t2 = time.perf_counter()
        return GenerationResult(tokens=progress.tokens(B), prefill_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3,
                                rounds=rounds, committed_hist=progress.hist.tolist(), phase_ms=timer.totals_ms())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
