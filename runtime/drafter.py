"""The Drafter seam: what proposes a round's Γ tokens.

A drafter proposes Γ tokens per slot (and, when sampling, the distributions they were drawn from, so that
rejection sampling stays exact), prefills its own state for newly admitted slots, observes each round's verdict
before the commit, and can expose its lookahead (the queries and keys of the drafted positions) for Dustin's
estimator. The round (round.py) calls nothing else, so a new drafter, an autoregressive model or a
block-parallel one, plugs in here without touching the round.

Implementations: drafters/no_draft.py (vanilla decoding: Γ = 0), drafters/model_drafter.py (an autoregressive
draft model), whose attention is one of drafters/full_cache.py (Classic SD), drafters/streaming_window.py
(MagicDec) or drafters/verification_set.py (sparse drafting), and drafters/longspark.py (a block-parallel drafter
of fixed per-round cost that reads the target's own cache and hidden states).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trtllm_dustin.runtime.prefill import PrefillJob
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["Drafter", "Lookahead", "PrefillView", "Proposal"]


@dataclass
class Proposal:
    """A round's drafted tokens. Both tensors are the drafter's own buffers (stable across rounds)."""

    tokens: torch.Tensor  # int64 [B, Γ]
    probs: torch.Tensor | None  # fp32 [B, Γ, V_target]: what each token was drawn from (None: all slots greedy)


@dataclass
class Lookahead:
    """The drafted positions as Dustin's estimator reads them (S_draft, Eq. 5), refreshed by every proposal."""

    queries: dict[int, torch.Tensor]  # draft layer -> [B, Γ, H_q, D] rotated queries of the Γ drafted positions
    keys: dict[int, torch.Tensor]  # draft layer -> [B, H_kv, S_max, D] the draft's cached keys of that layer
    confidence: torch.Tensor | None = None  # fp32 [B, Γ]: the draft's max probability at each step, if asked for


@dataclass
class PrefillView:
    """Slots whose prompts were just written into the caches, as the per-slot hooks see them."""

    slots: slice  # contiguous batch slots [start, stop)
    prompts: list[list[int]]
    lengths: torch.Tensor  # int32 [n]: prompt lengths
    queries: dict[int, torch.Tensor]  # target layer -> [n, H_q, D]: the last prompt token's rotated query
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # target layer -> [n, H]: its hidden state
    # target layer -> [n, R, H]: the hidden states of each prompt's last R positions (for the drafter's
    # `window_layers`, R = its `window_rows`), row r at position length - R + r; positions below window_start were not
    # run
    hidden_window: dict[int, torch.Tensor] = field(default_factory=dict)
    window_start: int = 0


class Drafter(Protocol):
    gamma: int  # tokens proposed per round
    target_query_layers: tuple[int, ...]  # target layers whose queries it reads (PrefillView, Observation)
    target_hidden_layers: tuple[int, ...]  # target layers whose hidden states it reads (PrefillView, Observation)
    # target layers whose hidden states of the prompt's last `window_rows` positions it reads at admission
    # (PrefillView.hidden_window; the ring drafter's); () and 0: none
    window_layers: tuple[int, ...]
    window_rows: int

    def prefill(self, slots: slice, prompts: Sequence[Sequence[int]], chunk: int, start: int = 0
                ) -> PrefillJob | None:
        """The job that writes the prompts into the drafter's own cache for slots [start, stop), chunk by chunk
        (None: it has no cache of its own); the decoder advances it beside the target's. start: the prompts' first
        positions already in that cache (a reused prefix), which the job does not write again."""

    def on_prefill(self, view: PrefillView) -> None:
        """Prompt-time state of newly admitted slots (after both prefills)."""

    def lookahead(self, layers: Sequence[int], confidence: bool = False) -> Lookahead:
        """Keep the drafted positions' queries of `layers` (and the draft's confidence) from now on; call before the
        first round. Raises ConfigError when the drafter has no such layers."""

    def propose(self, state: RoundState, sampling: SlotSampling, rows: slice | None = None) -> Proposal:
        """Γ tokens for every slot (idle ones included: fixed shapes), from the committed state. rows (the CPU, see
        Decoder._busy_rows): a drafter may run its model over those slots only; the others' tokens are then
        unspecified (they are idle: never committed)."""

    def observe(self, seen: Observation) -> None:
        """The round's verdict, before the commit (what a drafter keeps from a round)."""

    def capture(self, state: RoundState, greedy: bool) -> Proposal:
        """Run (and on CUDA capture) every fixed-shape step once before timing starts, drawing no randomness; return
        the proposal's buffers (what a verification captured after it reads)."""
