"""An autoregressive draft model proposes Γ tokens one step at a time (Classic SD, MagicDec, Dustin's drafts).

Step 0 processes (prev, cur) at (L_b - 1, L_b): rewriting prev is a no-op when the draft already has it and fills
the gap when the previous round accepted all Γ tokens (the draft never processed its own last token). Step i > 0
processes the token drafted at step i - 1, at L_b + i. What the draft attends to is its `DraftView`: its whole
cache (full_cache.py), a StreamingLLM window (streaming_window.py) or the verification set (verification_set.py).
Each step is a fixed-shape phase (a CUDA graph on the GPU); a greedy step picks its token inside its graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Protocol

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView, Proposal
from trtllm_dustin.runtime.prefill import PrefillJob, slot_range
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["DraftView", "ModelDrafter"]


class DraftView(Protocol):
    """Which cached positions the draft model attends to."""

    def metadata(self, lens: torch.Tensor) -> AttentionMetadata:
        """The attention metadata of a draft step whose new tokens start at positions `lens` [B]."""

    def on_prefill(self, view: PrefillView) -> None:
        """Prompt-time state of newly admitted slots."""

    def observe(self, seen: Observation) -> None:
        """What the view keeps from a round."""


class ModelDrafter:
    target_query_layers: tuple[int, ...] = ()  # it reads its own model's queries (lookahead), not the target's
    target_hidden_layers: tuple[int, ...] = ()
    window_layers: tuple[int, ...] = ()
    window_rows: int = 0

    def __init__(self, model: Transformer, cache: KVCache, view: DraftView, backend: AttentionBackend, gamma: int,
                 target_vocab: int, graphs: PhaseGraphs, use_kernel: bool = True) -> None:
        if gamma < 1:
            raise ValueError(f"gamma={gamma} must be >= 1 for a draft model")
        if model.config.vocab_size > target_vocab:
            raise ValueError(f"draft vocabulary ({model.config.vocab_size}) is larger than the target's "
                             f"({target_vocab}); the pair must share a tokenizer")
        self.model, self.cache, self.view, self.backend, self.gamma = model, cache, view, backend, gamma
        self.graphs, self.use_kernel = graphs, use_kernel
        self.vocab_size = model.config.vocab_size
        slots, device = cache.batch_slots, cache.seqlens.device
        self.tokens = torch.zeros(slots, gamma, dtype=torch.long, device=device)
        # Over the target's vocabulary: ids past the draft's (a pair may pad its tables differently) keep 0.
        self.probs = torch.zeros(slots, gamma, target_vocab, dtype=torch.float32, device=device)
        self.confidence: torch.Tensor | None = None
        self._captures: list[QueryCapture | None] = [None] * gamma
        # logit_index of each step: step 0 reads its second token (cur), the others their only one.
        self._last = [torch.full((slots,), 1 if step == 0 else 0, dtype=torch.long, device=device)
                      for step in range(gamma)]

    # ---- what the round calls ----------------------------------------------------------------------------
    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0) -> PrefillJob:
        return PrefillJob(self.model, self.cache, self.backend, prompts, chunk, start=start, slots=slots)

    def on_prefill(self, view: PrefillView) -> None:
        self.view.on_prefill(view)

    def lookahead(self, layers: Sequence[int], confidence: bool = False) -> Lookahead:
        config, layers = self.model.config, tuple(layers)
        bad = [layer for layer in layers if not 0 <= layer < config.num_layers]
        if bad:
            raise ConfigError(f"draft layers {bad} are outside the draft's {config.num_layers} layers; the Dustin "
                              "config was searched for another draft")
        if any(c is not None for c in self._captures):
            raise RuntimeError("the draft's lookahead is already kept for another reader; ask for it once")
        slots, device, dtype = self.tokens.shape[0], self.tokens.device, self.model.embed.weight.dtype
        queries = {layer: torch.zeros(slots, self.gamma, config.num_heads, config.head_dim, dtype=dtype,
                                      device=device) for layer in layers}
        # Step i keeps the query of its last token, the one at L_b + i.
        self._captures = [QueryCapture(layers, {layer: q[:, i: i + 1] for layer, q in queries.items()})
                          for i in range(self.gamma)] if layers else [None] * self.gamma
        if confidence:
            self.confidence = torch.ones(slots, self.gamma, dtype=torch.float32, device=device)
        return Lookahead(queries, {layer: self.cache.k[layer] for layer in layers}, self.confidence)

    def propose(self, state: RoundState, sampling: SlotSampling, rows: slice | None = None) -> Proposal:
        """The Γ steps; with `rows` (the CPU) the draft model runs over those slots only, reading each cache up to
        its longest sequence (an idle slot's logits are zero, its tokens unspecified)."""
        greedy = sampling.all_greedy
        for step in range(self.gamma):
            logits = self._step(state, step, greedy, rows)  # [B, V_draft]
            if greedy:  # the step picked its token inside its graph
                continue
            probs = sampling.probs(logits)
            self.tokens[:, step] = sampling.pick(logits, probs)
            self.probs[:, step, : self.vocab_size] = probs
        return Proposal(self.tokens, None if greedy else self.probs)

    def observe(self, seen: Observation) -> None:
        self.view.observe(seen)

    def capture(self, state: RoundState, greedy: bool) -> Proposal:
        """Capture every step (no sampling, no randomness drawn). Their side effects (draft K/V past the committed
        length, drafted tokens) are all rewritten by the next real round before being read."""
        for step in range(self.gamma):
            self._step(state, step, greedy)
        return Proposal(self.tokens, None if greedy else self.probs)

    # ---- one step ----------------------------------------------------------------------------------------
    def _step(self, state: RoundState, step: int, greedy: bool, rows: slice | None = None) -> torch.Tensor:
        """Step `step` as a fixed-shape phase (its CUDA graph on the GPU); a greedy one also writes its token."""
        if greedy:
            return self.graphs.run(f"draft{step}-greedy", partial(self._greedy_step, state, step, rows))
        return self.graphs.run(f"draft{step}", partial(self._forward, state, step, rows))

    def _forward(self, state: RoundState, step: int, rows: slice | None = None) -> torch.Tensor:
        L = state.lengths
        if step == 0:
            tokens, lens = torch.stack([state.prev, state.cur], dim=1), L - 1  # [B, 2] at L-1, L
        else:
            tokens, lens = self.tokens[:, step - 1: step], L + step  # [B, 1] at L+step
        meta, capture = self.view.metadata(lens), self._captures[step]
        if rows is not None:
            return self._forward_rows(tokens, meta, step, capture, rows)
        logits = self.model(tokens, self.cache, meta, self.backend, logit_index=self._last[step],
                            capture=capture)  # [B, V_draft]
        if self.confidence is not None:  # dustin-h-adaptive's signal: the draft's certainty at each step
            self.confidence[:, step] = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        return logits

    def _forward_rows(self, tokens: torch.Tensor, meta: AttentionMetadata, step: int, capture: QueryCapture | None,
                      rows: slice) -> torch.Tensor:
        """_forward over the slots `rows` only, each cache read up to their longest sequence; the others' logits 0."""
        lens = meta.cache_seqlens[rows]
        meta = replace(meta, cache_seqlens=lens, indices=None if meta.indices is None else meta.indices[rows],
                       max_kv_len=int(lens.max()) + tokens.shape[1])
        if capture is not None:  # views: the writes land in the lookahead's buffers
            capture = QueryCapture(capture.layers, {layer: q[rows] for layer, q in capture.queries.items()},
                                   {layer: h[rows] for layer, h in capture.hidden.items()})
        part = self.model(tokens[rows], slot_range(self.cache, rows), meta, self.backend,
                          logit_index=self._last[step][rows], capture=capture)  # [n, V_draft]
        logits = part.new_zeros((tokens.shape[0], part.shape[-1]))
        logits[rows] = part
        if self.confidence is not None:
            self.confidence[rows, step] = torch.softmax(part.float(), dim=-1).amax(dim=-1)
        return logits

    def _greedy_step(self, state: RoundState, step: int, rows: slice | None = None) -> torch.Tensor:
        """A greedy step that also writes its token, so the pick is inside the step's CUDA graph."""
        logits = self._forward(state, step, rows)
        self.tokens[:, step] = argmax_last(logits, use_kernel=self.use_kernel)
        return logits
