"""The ring drafter (trtllm_dustin/models/ring_drafter.py) on the Drafter seam: fixed-cost drafting, one slot after
another (evaluation only for now: runtime/experimental/methods.py registers it).

Per round, from each slot's committed state (cache length L, the committed token `cur` at position L):
- propose: `cur`'s output in the ring (at position L, fed with the target's hidden states at L - 1) proposes the
  first token, and Γ - 1 steps propose the rest, each fed the step before (greedy: argmax; sampled: each token drawn
  from the distribution it reports);
- observe: the accepted drafts (positions L + 1 .. L + accepted) and the target's next token after them (the next
  round's `cur`, at L + accepted + 1) enter the ring in one pass, fed with the verification pass's hidden states at
  L .. L + accepted; the next token's output is kept for the next proposal, and the boundary moves to the hidden
  state at L + accepted. One pass over the own layers' weights serves both, where entering `cur` at the start of the
  next round read them once more.
A slot admitted since the last round has no such output yet: that round's proposal first enters `cur` for every slot
(the "ring-propose-enter" phase; rewriting a row already entered writes what it holds).
At admission the ring pass runs over the prompt's last `fill_span` positions, as training's does, and their last W
fill the ring (the prefill keeps the target's hidden states there).
Nothing grows with the prefix: the state is the ring (W + block + 1 rows per own layer and slot) and the boundary.

Phases: "ring-propose", "ring-propose-enter" (greedy) and "ring-observe" are fixed-shape (CUDA graphs on the GPU).
Writing `cur` into its ring row and the slots into theirs is idempotent, so capturing a propose phase (run three
times) leaves the state as one run would; observe is captured once with no slot active (every entry invalid: the
ring and the kept outputs stay as they were).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models.ring_drafter import RingDrafter, RingState
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView, Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["RingDrafting"]


class RingDrafting:
    target_query_layers: tuple[int, ...] = ()

    def __init__(self, model: RingDrafter, slots: int, gamma: int, graphs: PhaseGraphs, use_kernel: bool = True
                 ) -> None:
        block = model.config.block
        if not 1 <= gamma <= block:
            raise ConfigError(f"--gamma {gamma}: this ring drafter proposes 1 .. {block} tokens per round; lower "
                              "--gamma")
        self.model, self.gamma, self.graphs, self.use_kernel = model, gamma, graphs, use_kernel
        target = model.target
        self.target_hidden_layers = model.config.read_layers
        # the prefill keeps the hidden states of the prompt's last fill_span + 1 positions: `fill` reads those at
        # p - 1 (the last one is the boundary)
        self.window_layers, self.window_rows = model.config.read_layers, model.fill_span + 1
        device, dtype = target.embed.weight.device, target.embed.weight.dtype
        self.vocab_size = target.config.vocab_size
        self.ring: RingState = model.new_state(slots, dtype)
        target.split_k_workspace(device)  # the fused path's partials, allocated here rather than in a round
        reads, H = len(self.target_hidden_layers), target.config.hidden_size
        self.boundary = torch.zeros(slots, reads, H, dtype=dtype, device=device)  # the target's at L - 1
        self.first = torch.zeros(slots, H, dtype=dtype, device=device)  # cur's output: the first proposal's
        self._fresh: set[int] = set()  # slots admitted since the last proposal: cur not yet entered (host-side)
        self.tokens = torch.zeros(slots, gamma, dtype=torch.long, device=device)
        self.probs = torch.zeros(slots, gamma, self.vocab_size, dtype=torch.float32, device=device)
        # observe's own copies of the verdict (the graph reads these)
        self._accepted = torch.zeros(slots, dtype=torch.long, device=device)
        self._active = torch.zeros(slots, dtype=torch.bool, device=device)
        self._entries = torch.zeros(slots, gamma + 1, dtype=torch.long, device=device)  # drafts, then the next token
        self._hidden = torch.zeros(slots, gamma + 1, reads, H, dtype=dtype, device=device)
        self._offsets = torch.arange(gamma + 1, device=device)
        self._rows = torch.arange(slots, device=device)
        self._observe_captured = False

    def state_bytes(self) -> int:
        """Bytes of per-run drafter state: the ring, the boundary and `cur`'s kept output."""
        r = self.ring
        return sum(t.numel() * t.element_size()
                   for t in (*r.joined_keys, *r.joined_values, r.positions, self.boundary, self.first))

    # ---- what the round calls ----------------------------------------------------------------------------
    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0) -> None:
        """No cache of its own: the ring is filled from the target's prefill (on_prefill)."""

    @torch.inference_mode()
    def on_prefill(self, view: PrefillView) -> None:
        missing = [layer for layer in self.window_layers if layer not in view.hidden_window]
        if missing:
            raise RuntimeError(f"the prefill kept no hidden-state window of target layers {missing}; the ring "
                               "drafter needs it")
        rows = self.window_rows
        start = view.slots.indices(self.boundary.shape[0])[0]
        n = view.lengths.shape[0]
        # [n, fill_span + 1, R, H]: the prompt's last positions' hidden states at the read layers
        window = torch.stack([view.hidden_window[layer] for layer in self.window_layers], dim=2)
        self.boundary[start: start + n] = window[:, -1]
        self._fresh.update(range(start, start + n))
        # ring positions length - span .. length - 1, each fed the hidden state at the position before it
        span = rows - 1
        lengths = view.lengths.long()[:, None]
        positions = lengths - span + torch.arange(span, device=lengths.device)
        hidden = window[:, :-1]
        # positions below 0 do not exist; below the prefill's start the target's states were not computed (a reused
        # prefix: those positions are left out, and the ring is then not training's); position 0 has no state
        # before it (training feeds it zeros)
        valid = (positions >= 0) & ((positions - 1 >= view.window_start) | (positions == 0))
        hidden = torch.where((positions == 0)[:, :, None, None], torch.zeros_like(hidden), hidden)
        tokens = torch.zeros(n, span, dtype=torch.long, device=lengths.device)
        for i, prompt in enumerate(view.prompts):
            tail = prompt[max(0, len(prompt) - span):]
            tokens[i, span - len(tail):] = torch.as_tensor(tail, dtype=torch.long)
        self.model.fill(self.ring.rows(slice(start, start + n)), tokens, hidden, positions, valid, outputs=False)

    def lookahead(self, layers: Sequence[int], confidence: bool = False) -> Lookahead:
        raise ConfigError("the ring drafter's queries live in its own layers' key spaces, not the target's: it has "
                          "no lookahead for Dustin's estimator; use a method whose selector does not read one")

    def propose(self, state: RoundState, sampling: SlotSampling, rows: slice | None = None) -> Proposal:
        """Every slot (rows are not used)."""
        enter, self._fresh = bool(self._fresh), set()
        if sampling.all_greedy:
            self.graphs.run("ring-propose-enter" if enter else "ring-propose", partial(self._greedy, state, enter))
            return Proposal(self.tokens, None)

        def draw(g: int, h: torch.Tensor) -> torch.Tensor:
            logits = self.model.logits(h)  # [B, V] fp32
            self.probs[:, g] = probs = sampling.probs(logits)
            return sampling.pick(logits, probs)

        self._draft(state, draw, enter)
        return Proposal(self.tokens, self.probs)

    def observe(self, seen: Observation) -> None:
        missing = [layer for layer in self.target_hidden_layers if layer not in seen.verify_hidden]
        if missing:
            raise RuntimeError(f"the verification kept no hidden states of target layers {missing}")
        self._capture_observe(seen.lengths)
        self._accepted.copy_(seen.accepted)
        self._active.copy_(seen.active)
        self._entries[:, : self.gamma].copy_(self.tokens)
        self._entries[self._rows, seen.accepted] = seen.next_tokens  # after the accepted drafts: the next `cur`
        for j, layer in enumerate(self.target_hidden_layers):  # per layer: no temporary per round
            self._hidden[:, :, j].copy_(seen.verify_hidden[layer])
        self.graphs.run("ring-observe", partial(self._observe, seen.lengths))

    def capture(self, state: RoundState, greedy: bool) -> Proposal:
        """Capture the greedy proposals, with and without entering `cur` (idempotent: `cur` and the slots rewrite
        their own ring rows), and the observe phase (with no slot active: an empty update)."""
        if greedy:
            self.graphs.run("ring-propose-enter", partial(self._greedy, state, True))
            self.graphs.run("ring-propose", partial(self._greedy, state, False))
        self._capture_observe(state.lengths)
        return Proposal(self.tokens, None if greedy else self.probs)

    def _capture_observe(self, lengths: torch.Tensor) -> None:
        if self.graphs.enabled and not self._observe_captured:
            self._active.zero_()
            self.graphs.run("ring-observe", partial(self._observe, lengths))
            self._observe_captured = True

    # ---- phases ------------------------------------------------------------------------------------------
    def _enter_cur(self, state: RoundState) -> torch.Tensor:
        """`cur` into the ring at L (fed the boundary) -> its output [B, H]: the first proposal's."""
        valid = torch.ones_like(state.cur, dtype=torch.bool)[:, None]
        return self.model.ingest(self.ring, state.cur[:, None], self.boundary[:, None], state.lengths.long()[:, None],
                                 valid)[:, 0]

    def _draft(self, state: RoundState, choose, enter: bool) -> torch.Tensor:
        """Γ proposals from `cur`'s output (entering `cur` into the ring first if `enter`; else observe kept it),
        slot g's token choose(g, its output h [B, H])."""
        h = self._enter_cur(state) if enter else self.first
        for g in range(self.gamma):
            if g:
                h = self.model.step(self.ring, g, self.tokens[:, g - 1], h, state.lengths.long())
            self.tokens[:, g] = choose(g, h)
        return self.tokens

    def _greedy(self, state: RoundState, enter: bool) -> torch.Tensor:
        return self._draft(state, lambda g, h: self.model.greedy(h, use_kernel=self.use_kernel), enter)

    def _observe(self, lengths: torch.Tensor) -> torch.Tensor:
        """The accepted drafts and the next `cur` into the ring (positions L + 1 .. L + accepted + 1, fed the
        verification's hidden states at L .. L + accepted); `cur`'s output is kept as the next first proposal's, and
        the boundary moves to the hidden state at L + accepted."""
        valid = (self._offsets[None] <= self._accepted[:, None]) & self._active[:, None]  # [B, Γ + 1]
        positions = lengths.long()[:, None] + 1 + self._offsets
        # [B, H]: cur's output alone (the drafts' rows need only their keys and values in the last layer)
        out = self.model.ingest(self.ring, self._entries, self._hidden, positions, valid, output_row=self._accepted)
        keep = self._active[:, None]
        self.first.copy_(torch.where(keep, out, self.first))
        self.boundary.copy_(torch.where(keep[..., None], self._hidden[self._rows, self._accepted], self.boundary))
        return self.boundary
