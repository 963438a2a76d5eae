"""The oracle verification set (evaluation only): what sparse verification could keep if it knew the answer.

Each round the oracle first runs the target over the round's Γ + 1 verification tokens with full attention (an
extra full pass: no deployable method can afford it) and takes every layer's true attention of those queries. Its
set is the top k of [0, L_b) by that attention:

  oracle           summed over all layers, heads and queries: one set for every layer and head, the shape Dustin's
                   layer-invariant set has (the ceiling of any [B, k] selector)
  per layer        summed over heads and queries, a set per layer: what layer invariance itself costs
  per KV head      summed over layers and each KV head's query heads: what one set for every head costs

The target's probabilities are normalised over the causal range [0, L_b + t] of query t, as the verification pass
sees them; the sets are sorted ascending and padded with -1, and hold all of [0, L_b) while L_b <= k. The full
pass writes the round's K/V at L_b .. L_b + Γ; the sparse verification that follows writes them again. The per-layer
sets reach the verification pass through the in-pass seam: every layer is a "selection layer" whose `choose` copies
that layer's set into the one the pass reads (LayerSets), so the model and the backends know one set per forward.
"""

from __future__ import annotations

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.selection import keep_all_indices
from trtllm_dustin.plugins.srh_score import srh_score
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation, RoundState

__all__ = ["ORACLE_KINDS", "LayerSets", "OracleSelector", "attention_mass", "full_pass", "top_k_set"]

ORACLE_KINDS = ("all", "layer", "kv-head")


def attention_mass(q: torch.Tensor, k_cache: torch.Tensor, lengths: torch.Tensor, per_kv_head: bool = False
                   ) -> torch.Tensor:
    """The attention the T queries at L_b + t put on each committed position j < L_b, summed over queries and heads:
    Eq. 5 over every query head (plugins.srh_score, softmax over the causal range [0, L_b + t]).

    q [B, T, H_q, D]; k_cache [B, H_kv, S, D]; lengths int32 [B]. Returns fp32 [B, S] (0 at j >= L_b), or
    [B, H_kv, S] summed within each KV head's query heads.
    """
    heads_q, heads_kv = q.shape[2], k_cache.shape[1]
    if not per_kv_head:
        return srh_score(q, k_cache, lengths, tuple(range(heads_q)))
    group = heads_q // heads_kv
    return torch.stack([srh_score(q, k_cache, lengths, tuple(range(g * group, (g + 1) * group)))
                        for g in range(heads_kv)], dim=1)


def full_pass(target: Transformer, cache: KVCache, backend: AttentionBackend, tokens: torch.Tensor, cur: torch.Tensor,
              drafts: torch.Tensor, lengths: torch.Tensor, capture: QueryCapture) -> None:
    """The target with full attention over each slot's round, `cur` [B] then the drafts [B, Γ], gathered into the
    preallocated `tokens` [B, Γ + 1], keeping what `capture` asks for. It writes the round's keys and values at
    L_b .. L_b + Γ; the verification pass after it writes its own over them."""
    tokens[:, 0] = cur
    tokens[:, 1:] = drafts
    target(tokens, cache, AttentionMetadata(cache_seqlens=lengths), backend, capture=capture)


def top_k_set(scores: torch.Tensor, lengths: torch.Tensor, budget: int, batch_axis: int = 0) -> torch.Tensor:
    """The top `budget` of [0, L_b) by scores, whose last axis is the positions and `batch_axis` the batch ([B, S],
    [B, H_kv, S]; [L, B, ...] with batch_axis 1): int32 of the same shape with `budget` in the last axis, sorted
    ascending; every position of [0, L_b) then -1 while L_b <= budget."""
    view = [1] * scores.dim()
    view[batch_axis] = lengths.shape[0]
    length = lengths.long().reshape(view)
    positions = torch.arange(scores.shape[-1], device=scores.device)
    every = keep_all_indices(lengths, budget).reshape(view[:-1] + [budget])
    if budget >= scores.shape[-1]:  # every L_b < S fits: nothing to choose
        return every.expand(*scores.shape[:-1], budget).contiguous()
    masked = scores.float().masked_fill(positions >= length, float("-inf"))
    chosen = torch.topk(masked, budget, dim=-1, sorted=False).indices.to(torch.int32).sort(dim=-1).values
    return torch.where(length > budget, chosen, every)


class OracleSelector(Selector):
    """The oracle set of one kind (ORACLE_KINDS), from a full pass of the target over the round's tokens."""

    def __init__(self, kind: str, budget: int, target: Transformer, cache: KVCache, backend: AttentionBackend,
                 draft_tokens: torch.Tensor) -> None:
        if kind not in ORACLE_KINDS:
            raise ValueError(f"oracle kind {kind!r}: choose one of {', '.join(ORACLE_KINDS)}")
        self.kind, self.budget, self.target, self.cache, self.backend = kind, budget, target, cache, backend
        self.per_layer = kind == "layer"
        slots, layers = draft_tokens.shape[0], target.config.num_layers
        self._layer_sets = torch.full((layers, slots, budget), -1, dtype=torch.int32, device=draft_tokens.device)
        self._set = torch.full((slots, budget), -1, dtype=torch.int32, device=draft_tokens.device)
        # per layer: each layer's set is copied into the one the pass reads as the pass reaches it
        self.in_pass = LayerSets(self._layer_sets, self._set) if self.per_layer else None
        self.draft_tokens = draft_tokens  # the drafter's proposal buffer [B, Γ]
        self.target_query_layers: tuple[int, ...] = ()
        self.state: RoundState | None = None
        config = target.config
        slots, gamma = draft_tokens.shape
        dtype = target.embed.weight.dtype
        self._queries = {layer: torch.zeros(slots, gamma + 1, config.num_heads, config.head_dim, dtype=dtype,
                                            device=draft_tokens.device) for layer in range(config.num_layers)}
        self._capture = QueryCapture(tuple(range(config.num_layers)), self._queries)
        self._tokens = torch.zeros(slots, gamma + 1, dtype=torch.long, device=draft_tokens.device)
        self._heads = tuple(range(config.num_heads))
        self._mass = torch.zeros(slots, cache.max_seq_len, dtype=torch.float32, device=draft_tokens.device)

    def bind(self, state: RoundState) -> None:
        """The decoder's round state: the oracle's full pass starts at the last committed token (state.cur)."""
        self.state = state

    def on_prefill(self, view: PrefillView) -> None:
        """No prompt-time state."""

    def estimate(self, lengths: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("OracleSelector: bind(decoder.state) first (the Decoder does when it is built)")
        full_pass(self.target, self.cache, self.backend, self._tokens, self.state.cur, self.draft_tokens, lengths,
                  self._capture)
        layers = range(self.target.config.num_layers)
        if self.kind == "all":  # summed over the layers in place
            for layer in layers:
                srh_score(self._queries[layer], self.cache.k[layer], lengths, self._heads, out=self._mass,
                          accumulate=layer > 0)
            return self._mass
        masses = [attention_mass(self._queries[layer], self.cache.k[layer], lengths, self.kind == "kv-head")
                  for layer in layers]
        return torch.stack(masses) if self.per_layer else torch.stack(masses).sum(0)

    def select(self, lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.per_layer:
            return top_k_set(scores, lengths, self.budget)
        self._layer_sets.copy_(top_k_set(scores, lengths, self.budget, batch_axis=1))  # [L, B, k]
        self._set.copy_(self._layer_sets[0])
        return self._set

    def layer_sets(self) -> torch.Tensor:
        """The per-layer oracle's sets of the last `select`, int32 [L, B, k]."""
        return self._layer_sets

    def observe(self, seen: Observation) -> None:
        """Nothing kept: every round's set comes from its own full pass."""

    def draft_share(self) -> None:
        return None


class LayerSets:
    """The per-layer oracle's sets as an in-pass selection: at every layer the pass reads that layer's set (copied
    into the shared one before the layer attends), over all slots or over a run of them (the CPU's busy rows)."""

    dense_layers: frozenset[int] = frozenset()

    def __init__(self, layer_sets: torch.Tensor, shared: torch.Tensor, rows: slice = slice(None)) -> None:
        self.layer_sets, self.shared, self.slots = layer_sets, shared, rows
        self.selection_layers = frozenset(range(layer_sets.shape[0]))

    def choose(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        self.shared[self.slots] = self.layer_sets[layer][self.slots]

    def rows(self, rows: slice) -> LayerSets:
        start = range(self.shared.shape[0])[self.slots][rows]
        return LayerSets(self.layer_sets, self.shared, slice(start.start, start.stop))
