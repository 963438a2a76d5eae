"""Dustin's verification set (paper Sec. 4): the target verifies against k positions chosen each round.

  estimate  S_draft = Eq. 5 over the draft's SRH queries of the Γ drafted positions, against the draft's keys;
            S_target = Eq. 5 over the target's SRH queries of the last committed token, recomputed against the
            full keys of the target's SRH layer(s), because the verification forward itself was sparse (4.2.3)
  select    I_verify = 4 sinks + 16 recent + TopK_m(S_draft) + TopK_rest(S_target)   (Eq. 6)

Variants (DustinConfig.variant): H keeps the searched m, T gives the whole free budget to S_target, D to S_draft.
With an AdaptiveShare (dustin-h-adaptive, evaluation only) m is chosen per slot and round and both are scored.

Two evaluation options (beyond the paper; runtime/methods.py registers them as evaluation-only methods):
  history_decay  S_target is a decayed running sum over rounds of every committed token's SRH attention (heavy
                 hitters): each round's verdict adds, for the a + 1 committed tokens at L .. L + a, their verification
                 queries scored against the full keys over their causal range, after the old sum is multiplied by the
                 decay. The prompt's last token starts it. Eager (observe), not in a captured phase.
  per_kv_head    a set per KV head ([B, H_kv, k]): the lookahead's m positions are shared, the rest of each KV head's
                 set is the top by the SRH heads of that KV head's group (by all SRH heads where its group has none).
"""

from __future__ import annotations

import torch

from trtllm_dustin.config import ModelConfig
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.selection import select_verify_indices
from trtllm_dustin.plugins.srh_score import srh_score
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.selectors.adaptive_share import AdaptiveShare
from trtllm_dustin.runtime.state import Observation

__all__ = ["DustinSelector"]


class DustinSelector(Selector):
    def __init__(self, config: DustinConfig, cache: KVCache, target: ModelConfig, query_dtype: torch.dtype,
                 lookahead: Lookahead, share: AdaptiveShare | None = None, pdl: bool = False,
                 history_decay: float | None = None, per_kv_head: bool = False) -> None:
        if history_decay is not None and not 0.0 <= history_decay <= 1.0:
            raise ValueError(f"history_decay {history_decay} must be in [0, 1] (1: plain sum over rounds)")
        self.cfg, self.cache, self.lookahead, self.share, self.pdl = config, cache, lookahead, share, pdl
        self.history_decay, self.per_kv_head = history_decay, per_kv_head
        self.budget = config.budget
        self.in_pass = None  # the set is chosen before the pass
        self.target_query_layers = tuple(lh.layer for lh in config.target_layers)
        slots, s_max, device = cache.batch_slots, cache.max_seq_len, cache.seqlens.device
        # The target's query of each slot's last committed token: round r's S_target history (at L_b - 1).
        self.history_q = {layer: torch.zeros(slots, 1, target.num_heads, target.head_dim, dtype=query_dtype,
                                             device=device) for layer in self.target_query_layers}
        self.s_draft = torch.zeros(slots, s_max, dtype=torch.float32, device=device)
        self.s_target = torch.zeros(slots, s_max, dtype=torch.float32, device=device)
        heads_kv = target.num_kv_heads
        self.indices = torch.full((slots, heads_kv, config.budget) if per_kv_head else (slots, config.budget), -1,
                                  dtype=torch.int32, device=device)
        accumulating = history_decay is not None
        self.s_history = torch.zeros(slots, s_max, dtype=torch.float32, device=device) if accumulating else None
        self._round_score = torch.zeros(slots, s_max, dtype=torch.float32, device=device) if accumulating else None
        # per_kv_head: each KV head's (layer, its SRH heads in that layer) pairs; empty where its group has none
        group = target.num_heads // heads_kv
        self._kv_heads = [[(lh.layer, own) for lh in config.target_layers
                           if (own := tuple(h for h in lh.heads if h // group == g))]
                          for g in range(heads_kv)] if per_kv_head else []
        self.s_target_kv = torch.zeros(slots, heads_kv, s_max, dtype=torch.float32, device=device) \
            if per_kv_head else None
        # the groups with SRH heads, as a device index built once (a host list would be copied inside a graph)
        self._scored_groups = torch.tensor([g for g, pairs in enumerate(self._kv_heads) if pairs], dtype=torch.long,
                                           device=device)
        self._rows = torch.arange(slots, device=device)
        self._fixed_m = torch.full((slots,), config.m, dtype=torch.long, device=device)
        free = config.budget - config.n_sink - config.n_recent
        self._score_draft = share is not None or config.m > 0  # Dustin-T never reads S_draft
        self._score_target = share is not None or config.m < free  # Dustin-D never reads S_target

    def on_prefill(self, view: PrefillView) -> None:
        for layer, history in self.history_q.items():  # round 1's target history is the prompt's last token
            history[view.slots, 0] = view.queries[layer]
        if self.s_history is not None:  # the running sum starts from the prompt's last token
            for i, lh in enumerate(self.cfg.target_layers):
                srh_score(view.queries[lh.layer][:, None], self.cache.k[lh.layer][view.slots], view.lengths - 1,
                          lh.heads, out=self.s_history[view.slots], accumulate=i > 0)

    def estimate(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._score_draft:  # the drafted queries at L .. L+Γ-1 over the context [0, L)
            for i, lh in enumerate(self.cfg.draft_layers):
                srh_score(self.lookahead.queries[lh.layer], self.lookahead.keys[lh.layer], lengths, lh.heads,
                          out=self.s_draft, accumulate=i > 0, pdl=self.pdl)
        if not self._score_target:
            return self.s_draft, self.s_target
        if self.per_kv_head:  # each group's SRH heads score its own row; S_target is their sum
            self._estimate_per_kv_head(lengths)
        elif self.s_history is not None:  # the running sum, kept up by observe
            self.s_target.copy_(self.s_history)
        else:  # the last committed token's query (at L - 1) over [0, L - 1)
            for i, lh in enumerate(self.cfg.target_layers):
                srh_score(self.history_q[lh.layer], self.cache.k[lh.layer], lengths - 1, lh.heads, out=self.s_target,
                          accumulate=i > 0, pdl=self.pdl)
        return self.s_draft, self.s_target

    def _estimate_per_kv_head(self, lengths: torch.Tensor) -> None:
        """S_target of each KV head's group, and their sum (the S_target of all SRH heads, since the groups split
        them), which a group without SRH heads takes: every head is scored once."""
        for g, pairs in enumerate(self._kv_heads):
            row = self.s_target_kv[:, g]
            for i, (layer, own) in enumerate(pairs):
                srh_score(self.history_q[layer], self.cache.k[layer], lengths - 1, own, out=row, accumulate=i > 0,
                          pdl=self.pdl)
        torch.sum(self.s_target_kv.index_select(1, self._scored_groups), dim=1, out=self.s_target)
        for g, pairs in enumerate(self._kv_heads):
            if not pairs:
                self.s_target_kv[:, g].copy_(self.s_target)

    def select(self, lengths: torch.Tensor, scores: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        s_draft, s_target = scores
        cfg = self.cfg
        m = self.share() if self.share is not None else cfg.m
        if self.per_kv_head:
            for g in range(self.indices.shape[1]):
                target_g = self.s_target_kv[:, g] if self._score_target else s_target
                self.indices[:, g].copy_(select_verify_indices(s_draft, target_g, lengths, cfg.budget, m, cfg.n_sink,
                                                               cfg.n_recent))
            return self.indices
        self.indices.copy_(select_verify_indices(s_draft, s_target, lengths, cfg.budget, m, cfg.n_sink,
                                                 cfg.n_recent))
        return self.indices

    def observe(self, seen: Observation) -> None:
        if self.s_history is not None:
            self._accumulate(seen)
        for layer, history in self.history_q.items():  # the query at L + a, the new last committed position
            q = seen.verify_queries[layer][self._rows, seen.accepted][:, None]  # [B, 1, H_q, D]
            history.copy_(torch.where(seen.active[:, None, None, None], q, history))

    def draft_share(self) -> torch.Tensor:
        return self.share.m if self.share is not None else self._fixed_m

    def _accumulate(self, seen: Observation) -> None:
        """history_decay: S_hist <- decay * S_hist + the SRH attention of the round's a + 1 committed tokens (query
        t at L + t over its causal range [0, L + t)), for the active slots."""
        score, history = self._round_score, self.s_history
        history.mul_(torch.where(seen.active, self.history_decay, 1.0)[:, None])
        verified = seen.verify_queries[self.cfg.target_layers[0].layer].shape[1]  # Γ + 1
        for t in range(verified):
            for i, lh in enumerate(self.cfg.target_layers):
                srh_score(seen.verify_queries[lh.layer][:, t:t + 1], self.cache.k[lh.layer], seen.lengths + t,
                          lh.heads, out=score, accumulate=i > 0)
            committed = seen.active & (seen.accepted >= t)  # query t is a committed token when t <= a
            history.addcmul_(score, committed[:, None].to(score.dtype))
