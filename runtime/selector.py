"""The Selector seam: the verification-set policy, what the target reads when it verifies a round.

A selector with `budget` None verifies against the full cache (Classic SD, MagicDec, vanilla). Otherwise
`estimate` scores the committed context and `select` returns the round's set I_verify, int32 [B, k] (distinct valid
cache positions, sorted ascending except for in-pass sets, which keep a fixed slot layout; -1 padding; all of
[0, L_b) while L_b <= k), one set per slot for every layer and head; an in-pass selector's verification pass rewrites
it at the selection layers.
Evaluation selectors may also return [B, H_kv, k] (a set per KV head); the per-layer oracle hands each layer its own
set through the in-pass seam (experimental/oracle.py). They run inside CUDA graphs, so they read only preallocated
buffers and return them (no host sync). Hooks: `bind` (the decoder's RoundState, once, when the decoder is built),
`on_prefill` (prompt-time state of newly admitted slots) and `observe` (each round's verdict, before the commit).

Implementations subclass Selector explicitly, which gives them the defaults of the optional members: a `bind` that
keeps nothing, and `estimates` True (a selector whose estimate has nothing to do says False, and the round runs no
estimate phase: on the GPU no CUDA graph is captured with nothing in it and replayed every round).

Implementations (selectors/): full.py (no selection), dustin.py (Dustin-H/T/D, Eq. 5-6; with adaptive_share.py
the input-aware share of dustin-h-adaptive), in_pass.py (the set chosen inside the verification pass from its own
queries: selection layers), streamingllm.py, snapkv.py, quest.py; the evaluation-only ones (the oracle, periodic
full verification) are in runtime/experimental/.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trtllm_dustin.attention import InPassSelection
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["Selector"]


class Selector(Protocol):
    budget: int | None  # k positions verified per slot; None: the full cache
    target_query_layers: tuple[int, ...]  # target layers whose queries the runtime keeps for it (prompt end, verify)
    # Selection inside the verification pass (selectors/in_pass.py): the pass rewrites the set at its selection
    # layers; None for selectors whose set is final before the pass.
    in_pass: InPassSelection | None

    def bind(self, state: RoundState) -> None:
        """The decoder's round state, handed once when the decoder is built (a selector that re-runs the target over
        the round's tokens reads it); the default keeps nothing."""
        return None

    def on_prefill(self, view: PrefillView) -> None:
        """Prompt-time state of newly admitted slots."""

    def estimates(self) -> bool:
        """Whether `estimate` does anything: False when it would only return None (its set follows the lengths, was
        fixed at the prompt or is chosen inside the pass), and `select` is then handed None. The default: True."""
        return True

    def estimate(self, lengths: torch.Tensor) -> Any:
        """Scores of the committed context [0, L_b) (its own buffers), for `select`."""

    def select(self, lengths: torch.Tensor, scores: Any) -> torch.Tensor | None:
        """The round's verification set, int32 [B, k] (its own buffer), or None for full verification."""

    def observe(self, seen: Observation) -> None:
        """The round's verdict, before the commit."""

    def draft_share(self) -> torch.Tensor | None:
        """int64 [B]: each slot's positions chosen by the draft's lookahead in the last set (Dustin's m); None for
        selectors without that split."""
