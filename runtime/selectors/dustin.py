"""Dustin's verification set (paper Sec. 4): the target verifies against k positions chosen each round.

  estimate  S_draft = Eq. 5 over the draft's SRH queries of the Γ drafted positions, against the draft's keys;
            S_target = Eq. 5 over the target's SRH queries of the last committed token, recomputed against the
            full keys of the target's SRH layer(s), because the verification forward itself was sparse (4.2.3)
  select    I_verify = 4 sinks + 16 recent + TopK_m(S_draft) + TopK_rest(S_target)   (Eq. 6)

Variants (DustinConfig.variant): H keeps the searched m, T gives the whole free budget to S_target, D to S_draft.
With an AdaptiveShare (dustin-h-adaptive, evaluation only) m is chosen per slot and round and both are scored.
"""

from __future__ import annotations

import torch

from trtllm_dustin.config import ModelConfig
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.selection import select_verify_indices
from trtllm_dustin.plugins.srh_score import srh_score
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView
from trtllm_dustin.runtime.selectors.adaptive_share import AdaptiveShare
from trtllm_dustin.runtime.state import Observation

__all__ = ["DustinSelector"]


class DustinSelector:
    def __init__(self, config: DustinConfig, cache: KVCache, target: ModelConfig, query_dtype: torch.dtype,
                 lookahead: Lookahead, share: AdaptiveShare | None = None, pdl: bool = False) -> None:
        self.cfg, self.cache, self.lookahead, self.share, self.pdl = config, cache, lookahead, share, pdl
        self.budget = config.budget
        self.target_query_layers = tuple(lh.layer for lh in config.target_layers)
        slots, s_max, device = cache.batch_slots, cache.max_seq_len, cache.seqlens.device
        # The target's query of each slot's last committed token: round r's S_target history (at L_b - 1).
        self.history_q = {layer: torch.zeros(slots, 1, target.num_heads, target.head_dim, dtype=query_dtype,
                                             device=device) for layer in self.target_query_layers}
        self.s_draft = torch.zeros(slots, s_max, dtype=torch.float32, device=device)
        self.s_target = torch.zeros(slots, s_max, dtype=torch.float32, device=device)
        self.indices = torch.full((slots, config.budget), -1, dtype=torch.int32, device=device)
        self._rows = torch.arange(slots, device=device)
        self._fixed_m = torch.full((slots,), config.m, dtype=torch.long, device=device)
        free = config.budget - config.n_sink - config.n_recent
        self._score_draft = share is not None or config.m > 0  # Dustin-T never reads S_draft
        self._score_target = share is not None or config.m < free  # Dustin-D never reads S_target

    def on_prefill(self, view: PrefillView) -> None:
        for layer, history in self.history_q.items():  # round 1's target history is the prompt's last token
            history[view.slots, 0] = view.queries[layer]

    def estimate(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._score_draft:  # the drafted queries at L .. L+Γ-1 over the context [0, L)
            for i, lh in enumerate(self.cfg.draft_layers):
                srh_score(self.lookahead.queries[lh.layer], self.lookahead.keys[lh.layer], lengths, lh.heads,
                          out=self.s_draft, accumulate=i > 0, pdl=self.pdl)
        if self._score_target:  # the last committed token's query (at L - 1) over [0, L - 1)
            for i, lh in enumerate(self.cfg.target_layers):
                srh_score(self.history_q[lh.layer], self.cache.k[lh.layer], lengths - 1, lh.heads, out=self.s_target,
                          accumulate=i > 0, pdl=self.pdl)
        return self.s_draft, self.s_target

    def select(self, lengths: torch.Tensor, scores: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        s_draft, s_target = scores
        cfg = self.cfg
        m = self.share() if self.share is not None else cfg.m
        self.indices.copy_(select_verify_indices(s_draft, s_target, lengths, cfg.budget, m, cfg.n_sink,
                                                 cfg.n_recent))
        return self.indices

    def observe(self, seen: Observation) -> None:
        for layer, history in self.history_q.items():  # the query at L + a, the new last committed position
            q = seen.verify_queries[layer][self._rows, seen.accepted][:, None]  # [B, 1, H_q, D]
            history.copy_(torch.where(seen.active[:, None, None, None], q, history))

    def draft_share(self) -> torch.Tensor:
        return self.share.m if self.share is not None else self._fixed_m
