"""The LongSpark drafter (trtllm_dustin/models/longspark.py) on the Drafter seam: fixed-cost block drafting.

Per round: one parallel block (all G slots, every block reading its target layer's recent window in the target's
cache and its fixed-size summary) gives the base logits of the Γ <= G proposed positions; then Γ sequential Markov
steps turn them into tokens (greedy: argmax; sampled: each token drawn from the distribution it reports). After
the verdict, `observe` folds the newly committed rows (at most Γ + 1 per slot) into each summary and takes the
boundary state from the verification pass's hidden states. Nothing here grows with the prefix: state is
(slots x layers x KV heads x R) summary entries plus (slots x layers x hidden) boundary states.

Phases: "longspark-block", "longspark-greedy" (the Markov steps and argmax) and "longspark-observe" are fixed-shape
(CUDA graphs on the GPU). The observe phase reads its own copies of the verdict, so it is captured once with no slot
active: an empty update, which leaves the state exactly as it was (summary_merge's contract).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.longspark import LongSpark, summary_merge, window_rows
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView, Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["LongSparkDrafter"]

_PREFILL_ROWS = 4096  # prompt rows folded into the summaries per merge at admission (bounds its memory)


class LongSparkDrafter:
    target_query_layers: tuple[int, ...] = ()
    window_layers: tuple[int, ...] = ()
    window_rows: int = 0

    def __init__(self, model: LongSpark, cache: KVCache, gamma: int, graphs: PhaseGraphs,
                 use_kernel: bool = True, kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """cache: the target's (its slots, lengths and, unless `kv` says otherwise, the K/V of the layers read).
        kv: target layer -> its K, V [B, H_kv, S_max, D] where the cache does not hold them (a pipeline's first
        stage: its own layers' and copies of the later stages')."""
        block = model.config.block
        if not 1 <= gamma <= block:
            raise ConfigError(f"--gamma {gamma}: this LongSpark drafter proposes 1 .. {block} tokens per round (its "
                              "block); lower --gamma")
        self.model, self.cache, self.gamma, self.graphs, self.use_kernel = model, cache, gamma, graphs, use_kernel
        self.layers = model.config.target_layers
        kv = kv if kv is not None else {layer: cache.layer(layer) for layer in self.layers}
        self.keys = {layer: kv[layer][0] for layer in self.layers}  # [B, H_kv, S_max, D] each
        self.values = {layer: kv[layer][1] for layer in self.layers}
        self.target_hidden_layers = self.layers  # the boundary states: read from the target's passes
        target = model.target
        self.vocab_size = target.config.vocab_size
        slots, device = cache.batch_slots, cache.seqlens.device
        dtype = target.embed.weight.dtype
        shapes = model.state_shapes(slots)
        self.summary_o = torch.zeros(shapes["summary_o"], dtype=torch.float32, device=device)
        self.summary_lse = torch.full(shapes["summary_lse"], float("-inf"), dtype=torch.float32, device=device)
        self.boundary = torch.zeros(shapes["boundary"], dtype=dtype, device=device)
        self.tokens = torch.zeros(slots, gamma, dtype=torch.long, device=device)
        self.probs = torch.zeros(slots, gamma, self.vocab_size, dtype=torch.float32, device=device)
        self.base = torch.zeros(slots, gamma, self.vocab_size, dtype=torch.float32, device=device)
        self.confidence: torch.Tensor | None = None
        self._capture: dict[int, torch.Tensor] | None = None
        self._rows = torch.arange(slots, device=device)
        # observe's own copies of the verdict (the graph reads these)
        self._accepted = torch.zeros(slots, dtype=torch.long, device=device)
        self._active = torch.zeros(slots, dtype=torch.bool, device=device)
        self._hidden = {layer: torch.zeros(slots, gamma + 1, target.config.hidden_size, dtype=dtype, device=device)
                        for layer in self.layers}
        self._offsets = torch.arange(gamma + 1, device=device)
        self._observe_captured = False

    def state_bytes(self) -> int:
        """Bytes of per-run drafter state (the window is the target's cache, not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.summary_o, self.summary_lse, self.boundary))

    # ---- what the round calls ----------------------------------------------------------------------------
    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0
                ) -> None:  # no job
        """No cache of its own: it reads the target's."""

    @torch.inference_mode()
    def on_prefill(self, view: PrefillView) -> None:
        missing = [layer for layer in self.layers if layer not in view.hidden]
        if missing:
            raise RuntimeError(f"the prefill kept no hidden states of target layers {missing}; LongSpark needs them")
        self.boundary[view.slots] = torch.stack([view.hidden[layer] for layer in self.layers], dim=1)
        start = view.slots.indices(self.cache.batch_slots)[0]
        n = view.lengths.shape[0]
        o = torch.zeros_like(self.summary_o[start: start + n])
        lse = torch.full_like(self.summary_lse[start: start + n], float("-inf"))
        longest = int(view.lengths.max())
        for begin in range(0, longest, _PREFILL_ROWS):
            end = min(begin + _PREFILL_ROWS, longest)
            valid = (torch.arange(begin, end, device=view.lengths.device)[None] < view.lengths[:, None].long())
            for j, layer in enumerate(self.layers):
                k = self.keys[layer][start: start + n, :, begin:end]  # [n, H_kv, rows, D]
                v = self.values[layer][start: start + n, :, begin:end]
                o_j, lse_j = summary_merge(o[:, j], lse[:, j], self.model.summary_scores(j, k), v.float(),
                                           valid[:, None, :].expand(-1, k.shape[1], -1))
                o[:, j], lse[:, j] = o_j, lse_j
        self.summary_o[start: start + n] = o
        self.summary_lse[start: start + n] = lse

    def lookahead(self, layers: Sequence[int], confidence: bool = False) -> Lookahead:
        """Lookahead of LongSpark blocks `layers` (block indices): the queries of the Γ proposed positions, in the
        key space of each block's target layer, with that layer's full cached keys to score against."""
        layers = tuple(layers)
        bad = [j for j in layers if not 0 <= j < len(self.layers)]
        if bad:
            raise ConfigError(f"LongSpark blocks {bad} do not exist (it has {len(self.layers)}, reading target layers "
                              f"{list(self.layers)})")
        if confidence:
            raise ConfigError("LongSpark reports no per-step confidence; dustin-h-adaptive needs a draft model")
        if self._capture is not None:
            raise RuntimeError("LongSpark's lookahead is already kept for another reader; ask for it once")
        target = self.model.target.config
        slots, device, dtype = self.tokens.shape[0], self.tokens.device, self.boundary.dtype
        self._capture = {j: torch.zeros(slots, self.gamma, target.num_heads, target.head_dim, dtype=dtype,
                                        device=device) for j in layers}
        return Lookahead(dict(self._capture), {j: self.keys[self.layers[j]] for j in layers})

    def propose(self, state: RoundState, sampling: SlotSampling, rows: slice | None = None) -> Proposal:
        """Every slot (its block costs one small forward; rows are not used)."""
        self.graphs.run("longspark-block", partial(self._block, state))
        if sampling.all_greedy:
            self.graphs.run("longspark-greedy", partial(self._greedy, state))
            return Proposal(self.tokens, None)
        previous = state.cur
        for i in range(self.gamma):
            logits = self.base[:, i] + self.model.markov(i, previous)
            probs = sampling.probs(logits)
            self.tokens[:, i] = sampling.pick(logits, probs)
            self.probs[:, i] = probs
            previous = self.tokens[:, i]
        return Proposal(self.tokens, self.probs)

    def observe(self, seen: Observation) -> None:
        missing = [layer for layer in self.layers if layer not in seen.verify_hidden]
        if missing:
            raise RuntimeError(f"the verification kept no hidden states of target layers {missing}")
        self._capture_observe(seen.lengths)  # before the copies: capturing runs the phase three times
        self._accepted.copy_(seen.accepted)
        self._active.copy_(seen.active)
        for layer in self.layers:
            self._hidden[layer].copy_(seen.verify_hidden[layer])
        self.graphs.run("longspark-observe", partial(self._observe, seen.lengths))

    def capture(self, state: RoundState, greedy: bool) -> Proposal:
        """Capture the block, the greedy steps and the observe phase (with no slot active: an empty update)."""
        self.graphs.run("longspark-block", partial(self._block, state))
        if greedy:
            self.graphs.run("longspark-greedy", partial(self._greedy, state))
        self._capture_observe(state.lengths)
        return Proposal(self.tokens, None if greedy else self.probs)

    def _capture_observe(self, lengths: torch.Tensor) -> None:
        """Capture the observe phase once, with no slot active (an empty update: the state stays exactly as it was),
        whoever first needs it: a real round's verdict must be folded in once, not once per capture run."""
        if self.graphs.enabled and not self._observe_captured:
            self._active.zero_()
            self.graphs.run("longspark-observe", partial(self._observe, lengths))
            self._observe_captured = True

    # ---- phases ------------------------------------------------------------------------------------------
    def _block(self, state: RoundState) -> torch.Tensor:
        model, lengths = self.model, state.lengths
        windows = [window_rows(self.keys[layer], self._rows, lengths, model.config.window)
                   for layer in self.layers]
        windows = [(k, window_rows(self.values[layer], self._rows, lengths, model.config.window)[0], valid)
                   for (k, valid), layer in zip(windows, self.layers, strict=True)]
        hidden = model.backbone(state.cur, lengths, self.boundary, windows, self.summary_o, self.summary_lse,
                                self._capture)
        self.base.copy_(model.base_logits(hidden[:, : self.gamma]))
        return self.base

    def _greedy(self, state: RoundState) -> torch.Tensor:
        previous = state.cur
        for i in range(self.gamma):
            logits = self.base[:, i] + self.model.markov(i, previous)
            self.tokens[:, i] = argmax_last(logits, use_kernel=self.use_kernel)
            previous = self.tokens[:, i]
        return self.tokens

    def _observe(self, lengths: torch.Tensor) -> torch.Tensor:
        """Fold rows L .. L + accepted (committed by this round; the verification wrote them) into each summary and
        move the boundary to the last of them."""
        valid = (self._offsets[None] <= self._accepted[:, None]) & self._active[:, None]  # [B, Γ + 1]
        positions = (lengths.long()[:, None] + self._offsets).clamp(max=self.cache.max_seq_len - 1)  # [B, Γ + 1]
        rows = self._rows[:, None]
        for j, layer in enumerate(self.layers):
            k = self.keys[layer][rows, :, positions].transpose(1, 2)  # [B, H_kv, Γ + 1, D]
            v = self.values[layer][rows, :, positions].transpose(1, 2)
            o, lse = summary_merge(self.summary_o[:, j], self.summary_lse[:, j], self.model.summary_scores(j, k),
                                   v.float(), valid[:, None, :].expand(-1, k.shape[1], -1))
            self.summary_o[:, j].copy_(o)
            self.summary_lse[:, j].copy_(lse)
        new = torch.stack([self._hidden[layer][self._rows, self._accepted] for layer in self.layers], dim=1)
        self.boundary.copy_(torch.where(self._active[:, None, None], new, self.boundary))
        return self.summary_lse
