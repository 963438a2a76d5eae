"""Dustin: Classic SD's drafting plus sparse verification over k positions chosen each round (paper Sec. 4).

Per round, on the device:
  estimate  S_draft = Eq. 5 over the draft's SRH queries of the Γ drafted positions, against the draft's keys;
            S_target = Eq. 5 over the target's SRH queries of the last committed token, recomputed against the
            full keys of the target's SRH layer(s), because the verification forward itself was sparse (4.2.3)
  select    I_verify = 4 sinks + 16 recent + TopK_m(S_draft) + TopK_rest(S_target)   (Eq. 6)
  verify    every target layer attends to I_verify plus the Γ+1 new tokens
"""

from __future__ import annotations

import torch

from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models.decoder import QueryCapture
from trtllm_dustin.runtime.speculative import SpeculativeDecoder

__all__ = ["Dustin"]


class Dustin(SpeculativeDecoder):
    name = "dustin"

    def __init__(self, *args, dustin: DustinConfig, variant: str = "h", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dustin.check_models(self.target.config, self.draft.config)
        self.cfg = dustin.variant(variant)
        self.variant = variant
        self.name = f"dustin-{variant}"
        B, S = self.tcache.batch_slots, self.tcache.max_seq_len
        t, d, dev = self.target.config, self.draft.config, self.device
        self.target_capture_layers = tuple(lh.layer for lh in self.cfg.target_layers)
        # Queries of the SRH layers: the draft's Γ lookahead queries, the target's Γ+1 verify queries, and the
        # target's query of the last committed token (its "history" for the next round).
        dq, tq = self.draft.embed.weight.dtype, self.target.embed.weight.dtype  # the models', not the caches' dtype
        self.draft_q = {lh.layer: torch.zeros(B, self.gamma, d.num_heads, d.head_dim, dtype=dq, device=dev)
                        for lh in self.cfg.draft_layers}
        self.verify_q = {lh.layer: torch.zeros(B, self.gamma + 1, t.num_heads, t.head_dim, dtype=tq, device=dev)
                         for lh in self.cfg.target_layers}
        self.history_q = {layer: torch.zeros(B, 1, t.num_heads, t.head_dim, dtype=tq, device=dev)
                          for layer in self.verify_q}
        self.s_draft = torch.zeros(B, S, dtype=torch.float32, device=dev)
        self.s_target = torch.zeros(B, S, dtype=torch.float32, device=dev)
        self.indices = torch.full((B, self.cfg.budget), -1, dtype=torch.int32, device=dev)
        self._draft_captures = [QueryCapture(tuple(self.draft_q), {layer: q[:, i: i + 1] for layer, q in
                                                                   self.draft_q.items()}) for i in range(self.gamma)]
        self._verify_capture = QueryCapture(tuple(self.verify_q), dict(self.verify_q))

    def draft_capture(self, step: int) -> QueryCapture | None:
        return self._draft_captures[step] if self.draft_q else None

    def verify_capture(self) -> QueryCapture | None:
        return self._verify_capture if self.verify_q else None

    def after_prefill(self, last_queries: dict[int, torch.Tensor], batch: int) -> None:
        for layer, q in last_queries.items():  # round 1's target history is the prompt's last token
            self.history_q[layer][:batch, 0] = q

    def after_commit(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        for layer, q in self.verify_q.items():  # the query at L + a, the new last committed position
            self.history_q[layer].copy_(torch.where(active[:, None, None, None], q[self.rows, accepted][:, None],
                                                    self.history_q[layer]))

    def estimate(self) -> None:
        if self.cfg.m > 0:  # Dustin-T never reads S_draft
            self.score_draft()
        if self.cfg.m < self.cfg.budget - self.cfg.n_sink - self.cfg.n_recent:  # Dustin-D never reads S_target
            self.score_target()

    def score_draft(self) -> None:
        """S_draft: the draft's SRH layers, drafted queries at L .. L+Γ-1 over the context [0, L)."""
        from trtllm_dustin.plugins import srh_score

        for i, lh in enumerate(self.cfg.draft_layers):
            srh_score(self.draft_q[lh.layer], self.dcache.k[lh.layer], self.tcache.seqlens, lh.heads,
                      out=self.s_draft, accumulate=i > 0)

    def score_target(self) -> None:
        """S_target: the target's SRH layers, the last committed token's query (at L - 1) over [0, L - 1)."""
        from trtllm_dustin.plugins import srh_score

        for i, lh in enumerate(self.cfg.target_layers):
            srh_score(self.history_q[lh.layer], self.tcache.k[lh.layer], self.tcache.seqlens - 1, lh.heads,
                      out=self.s_target, accumulate=i > 0)

    def select(self) -> None:
        from trtllm_dustin.plugins import select_verify_indices

        self.indices.copy_(select_verify_indices(self.s_draft, self.s_target, self.tcache.seqlens, self.cfg.budget,
                                                 self.cfg.m, self.cfg.n_sink, self.cfg.n_recent))
