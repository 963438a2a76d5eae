"""Quest as a verification set: pages of 16 tokens with per-channel min/max keys.

A page's bound for query head h is U = sum_d max(q_d min_d, q_d max_d) (Quest). Deviations, because one set serves
every layer and head: each head's bounds become a softmax over the complete pages (which keeps that head's page
ranking and puts the heads on one scale) and are summed over the query heads of layers n_dense.. (Quest's two dense
layers cannot be dense here: they read the same set); the query is the target's query of the last committed token,
captured by the previous verification (the verify tokens' own queries do not exist before the forward; Dustin-T
reads the same one). As in Quest the current, partial page is always kept; then whole pages by rank until k
positions (the last one cut to fit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.selection import keep_all_indices
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation

__all__ = ["QuestSelector", "quest_indices", "quest_page_scores"]


def quest_page_scores(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor], seqlens: torch.Tensor,
                      page: int = 16) -> torch.Tensor:
    """Quest's page importance for one index set -> fp32 [B, P], P = ceil(S / page).

    queries[l]: [B, H_q, D] one query per sequence; keys[l]: [B, H_kv, S, D]. For each complete page p (all of
    [p * page, (p + 1) * page) inside [0, L_b)) and query head h: U = sum_d max(q_d min_d, q_d max_d) with min/max
    over the page's keys per channel (Quest's upper bound of q.k), softmax over the complete pages of U / sqrt(D),
    summed over heads and layers. Incomplete pages score 0.
    """
    total = None
    for q, k in zip(queries, keys, strict=True):
        B, Hq, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        P = -(-S // page)
        paged = F.pad(k.float(), (0, 0, 0, P * page - S)).view(B, Hkv, P, page, D)
        k_min, k_max = paged.amin(dim=3), paged.amax(dim=3)  # [B, H_kv, P, D]
        qg = q.float().view(B, Hkv, Hq // Hkv, 1, D)  # [B, H_kv, G, 1, D]
        bound = torch.maximum(qg * k_min[:, :, None], qg * k_max[:, :, None]).sum(-1) / math.sqrt(D)  # [B,H_kv,G,P]
        complete = (torch.arange(P, device=q.device)[None, :] + 1) * page <= seqlens.long()[:, None]  # [B, P]
        probs = torch.softmax(bound.masked_fill(~complete[:, None, None], float("-inf")), dim=-1)
        layer_score = torch.where(complete, probs.sum(dim=(1, 2)), 0.0)  # no complete page: NaN rows dropped
        total = layer_score if total is None else total + layer_score
    if total is None:
        raise ValueError("quest: no layers given")
    return total


def quest_indices(page_scores: torch.Tensor, seqlens: torch.Tensor, budget: int, page: int = 16) -> torch.Tensor:
    """Quest's set: the current partial page [page * floor(L_b / page), L_b), then complete pages by score, each in
    position order, until `budget` positions (the last page taken cut to fit) -> int32 [B, budget] sorted."""
    B, P = page_scores.shape
    if budget >= P * page:  # every L_b <= S <= P * page fits
        return keep_all_indices(seqlens, budget)
    lengths = seqlens.long()[:, None]
    complete = (torch.arange(P, device=seqlens.device)[None, :] + 1) * page <= lengths  # [B, P]
    order = torch.sort(page_scores.float().masked_fill(~complete, float("-inf")), dim=1, descending=True,
                       stable=True).indices  # [B, P] pages, best first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(P, device=order.device).expand(B, P))
    positions = torch.arange(P * page, device=seqlens.device)[None, :]  # [1, P*page]
    within = positions % page
    key = -(rank.gather(1, (positions // page).expand(B, -1)) * page + within).float()  # [B, P*page]
    current = (positions >= lengths // page * page) & (positions < lengths)
    key = torch.where(current, 1.0, key).masked_fill(positions >= lengths, float("-inf"))
    chosen = torch.topk(key, budget, dim=1).indices.sort(dim=1).values.to(torch.int32)
    return torch.where(seqlens[:, None] > budget, chosen, keep_all_indices(seqlens, budget))


class QuestSelector(Selector):
    """Quest's page selection with one set per slot (see the module doc for the deviations)."""

    def __init__(self, budget: int, n_sink: int, cache: KVCache, target: ModelConfig, query_dtype: torch.dtype,
                 page: int = 16, n_dense: int = 2) -> None:
        if not 0 <= n_sink < budget:
            raise ConfigError(f"quest: n_sink={n_sink} must lie in [0, budget k={budget})")
        if not 0 <= n_dense < target.num_layers:
            raise ConfigError(f"quest: n_dense={n_dense} must leave at least one of {target.num_layers} layers to "
                              "score")
        if page < 1:
            raise ConfigError(f"quest: page size {page} must be >= 1")
        self.budget, self.page, self.cache = budget, page, cache
        self.in_pass = None  # pages are ranked before the pass
        self.target_query_layers = tuple(range(n_dense, target.num_layers))
        slots, s_max, device = cache.batch_slots, cache.max_seq_len, cache.seqlens.device
        self.history_q = {layer: torch.zeros(slots, target.num_heads, target.head_dim, dtype=query_dtype,
                                             device=device) for layer in self.target_query_layers}
        self.page_scores = torch.zeros(slots, -(-s_max // page), dtype=torch.float32, device=device)
        self.indices = torch.full((slots, budget), -1, dtype=torch.int32, device=device)
        self._rows = torch.arange(slots, device=device)

    def on_prefill(self, view: PrefillView) -> None:
        for layer, history in self.history_q.items():  # round 1 scores with the prompt's last query
            history[view.slots] = view.queries[layer]

    def estimate(self, lengths: torch.Tensor) -> torch.Tensor:
        layers = self.target_query_layers
        self.page_scores.copy_(quest_page_scores([self.history_q[layer] for layer in layers],
                                                 [self.cache.k[layer] for layer in layers], lengths, self.page))
        return self.page_scores

    def select(self, lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.indices.copy_(quest_indices(scores, lengths, self.budget, self.page))
        return self.indices

    def observe(self, seen: Observation) -> None:
        for layer, history in self.history_q.items():  # the query at L + a, the new last committed position
            q = seen.verify_queries[layer][self._rows, seen.accepted]  # [B, H_q, D]
            history.copy_(torch.where(seen.active[:, None, None], q, history))

    def draft_share(self) -> None:
        return None
