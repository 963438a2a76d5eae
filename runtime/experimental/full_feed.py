"""The ring drafter under in-pass selection, fed the hidden states of a full pass (evaluation only, issue 38).

The ring drafter enters each committed position with the target's hidden states at the position before it, and it
takes them from the verification pass (runtime/drafters/ring.py, `observe`). Under in-pass selection that pass is
sparse: the layers before the selection layer read the previous round's set and the layers after it the set the
round chose, so the states the drafter reads are not the full-attention states it was trained on. With sparse
verification the ring drafter's tau falls further than the AR draft's, and this method measures how much of that
fall comes from its inputs rather than from the sparse target's own choices:

  selector  the in-pass selector, wrapped: before the verification pass (the estimate phase), the target runs once
            more over the round's Γ + 1 tokens with full attention and keeps the hidden states of the drafter's read
            layers. That pass writes the round's keys and values, and the sparse pass after it writes its own over
            them, so the cache and every verdict are in-pass selection's.
  drafter   the ring drafter, whose `observe` reads those states instead of the verification's.

One full pass per round: no deployable method can afford it (it costs what vanilla decoding of Γ + 1 tokens costs).
Measured on the real pair (benchmarks/results/longspark2/README.md, tenth step): the same greedy tau as dustin-ip-ring
(2.779 against 2.777 on the test split), so the drafter's inputs are not what in-pass selection costs it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from trtllm_dustin.attention import AttentionBackend, InPassSelection
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.drafters.ring import RingDrafting
from trtllm_dustin.runtime.experimental.oracle import full_pass
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["FullPassFeed", "FullFedRingDrafting"]


class FullFedRingDrafting(RingDrafting):
    """The ring drafter, whose observe reads `feed` (target layer -> [B, Γ + 1, H], set by FullPassFeed) in place of
    the verification pass's hidden states."""

    feed: dict[int, torch.Tensor] | None = None

    def observe(self, seen: Observation) -> None:
        if self.feed is None:
            raise RuntimeError("FullFedRingDrafting: no full-pass feed attached (build it with FullPassFeed)")
        super().observe(replace(seen, verify_hidden=self.feed))


class FullPassFeed(Selector):
    """Wraps a selector: its estimate first runs the target with full attention over the round's tokens (the last
    committed one and the drafts) and keeps the drafter's read layers' hidden states (`hidden`, [B, Γ + 1, H] per
    layer); everything else is the wrapped selector's."""

    def __init__(self, inner: Selector, target: Transformer, cache: KVCache, backend: AttentionBackend,
                 drafter: FullFedRingDrafting) -> None:
        self.inner, self.target, self.cache, self.backend, self.drafter = inner, target, cache, backend, drafter
        slots, gamma = drafter.tokens.shape
        device, dtype = drafter.tokens.device, target.embed.weight.dtype
        self.hidden = {layer: torch.zeros(slots, gamma + 1, target.config.hidden_size, dtype=dtype, device=device)
                       for layer in drafter.target_hidden_layers}
        self._capture = QueryCapture((), {}, self.hidden)
        self._tokens = torch.zeros(slots, gamma + 1, dtype=torch.long, device=device)
        self.state: RoundState | None = None
        drafter.feed = self.hidden

    @property
    def budget(self) -> int | None:
        return self.inner.budget

    @property
    def target_query_layers(self) -> tuple[int, ...]:
        return self.inner.target_query_layers

    @property
    def in_pass(self) -> InPassSelection | None:
        return self.inner.in_pass

    def bind(self, state: RoundState) -> None:
        self.state = state
        self.inner.bind(state)

    def on_prefill(self, view: PrefillView) -> None:
        self.inner.on_prefill(view)

    def estimate(self, lengths: torch.Tensor) -> Any:
        if self.state is None:
            raise RuntimeError("FullPassFeed: bind(decoder.state) first (the Decoder does when it is built)")
        full_pass(self.target, self.cache, self.backend, self._tokens, self.state.cur, self.drafter.tokens, lengths,
                  self._capture)
        return self.inner.estimate(lengths)

    def select(self, lengths: torch.Tensor, scores: Any) -> torch.Tensor | None:
        return self.inner.select(lengths, scores)

    def observe(self, seen: Observation) -> None:
        self.inner.observe(seen)

    def draft_share(self) -> torch.Tensor | None:
        return self.inner.draft_share()
