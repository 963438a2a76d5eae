"""In-pass selection: the verification pass chooses its own set from the target's queries of the round.

Dustin's estimator (dustin.py) scores the context before the pass, with the draft's lookahead and the last committed
token's history, and loses retrieved facts where those queries do not look where the verified tokens do. Here the
set is chosen inside the verification forward, from the queries that are being verified:

  pre-pass   the set the round begins with: the previous round's choice, its recent window moved to [L_b - 16, L_b)
             (read by the layers before the first selection layer, unless `dense_layers` makes them full)
  choose     at a selection layer l (TidalDecode / OmniKV style): S_l[j] = Eq. 5 over the layer's scoring heads and
             the Γ + 1 verified queries at L_b .. L_b + Γ, normalised over their causal range; the set becomes
             4 sinks + TopK_free(S_l) + the 16 recent positions, which layer l and the following layers read. A later
             selection layer chooses again from its own queries. With the config's score_window w > 1, S_l is first
             replaced by its sliding max (or mean) over w neighbouring positions, so a chosen position brings its
             neighbours (SnapKV pools its scores the same way).
  pool       the config's `pool_layers` (below the first selection layer) score their own verification queries on
             their heads as the pass goes through them; the first selection layer adds its scores to theirs and
             chooses from the sum (the oracle's set sums every layer's attention; pooling approaches it at one
             scoring pass per pooled layer)
  pages      (Quest style) the same (pooling included) with S_l from page bounds: per 16-key page the upper bound
             sum_d max(q_d min_d, q_d max_d) of q.k (Quest), as q+ . max + q- . min, a softmax over the pages per head,
             summed over heads and queries; a page's score is each of its positions' score, so the top-k takes whole
             pages. The selection reads the pages' min/max keys (an eighth of K) instead of every key.
  lookahead  with m > 0 the draft's lookahead (S_draft over its Γ drafted queries, Eq. 5, as Dustin-H scores it) takes
             m positions before the pass fills the rest (Eq. 6 with S_target replaced by S_l).

The set's layout is fixed, which is what lets the pre-pass move the recent window in place without a duplicate:
slots [0, 4) hold the sinks, [4, k - 16) the chosen positions (all < L_sel - 16 at their choice, so below any later
recent window), [k - 16, k) the recent window; while L_b <= k the set is every position of [0, L_b) (then -1).
Everything is fixed-shape torch and Triton work on preallocated buffers (no host sync), inside the captured verify
pass; the prompt's last token seeds the first round's set.
"""

from __future__ import annotations

import math

import torch

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.selection import keep_all_indices, window_scores
from trtllm_dustin.plugins.srh_score import srh_score
from trtllm_dustin.runtime.drafter import Lookahead, PrefillView
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation

__all__ = ["PAGE", "InPassSelector", "head_weights", "page_bounds", "page_key_range"]

PAGE = 16  # keys per page of the page-bound variant (Quest's page size)


def page_key_range(keys: torch.Tensor, lengths: torch.Tensor, page: int = PAGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page of `page` keys, the channel-wise min and max over its committed positions (< L_b).

    keys [B, H_kv, S, D] (any float dtype) -> fp32 (min, max), each [B, H_kv, P, D], P = ceil(S / page); a page with
    no committed position holds zeros (page_bounds masks it).
    """
    B, H, S, D = keys.shape
    P = -(-S // page)
    paged = torch.nn.functional.pad(keys.float(), (0, 0, 0, P * page - S)).view(B, H, P, page, D)
    valid = (torch.arange(P * page, device=keys.device)[None, :] < lengths.long()[:, None]).view(B, 1, P, page, 1)
    return _masked_range(paged, valid)


def _masked_range(paged: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """paged [B, H, P, page, D], valid broadcastable bool -> (min, max) over the valid keys of each page, 0 where a
    page has none."""
    low = paged.masked_fill(~valid, float("inf")).amin(dim=3)
    high = paged.masked_fill(~valid, float("-inf")).amax(dim=3)
    empty = ~valid.any(dim=3)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


def head_weights(heads: tuple[int, ...], num_heads: int, device: torch.device) -> torch.Tensor:
    """fp32 [H_q]: 1 for the scoring heads, 0 for the others (page_bounds' `weights`; built once, outside a graph)."""
    weights = torch.zeros(num_heads)
    weights[list(heads)] = 1.0
    return weights.to(device)


def page_bounds(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor, lengths: torch.Tensor,
                weights: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    """Quest's page importance of the T queries q [B, T, H_q, D] -> fp32 [B, P].

    For query head h and page p with key range [min, max]: U = sum_d max(q_d min_d, q_d max_d) (an upper bound of q.k
    over the page), computed as q+ . max + q- . min; a softmax over the pages holding a committed position (< L_b) of
    U / sqrt(D) per head and query, summed over the T queries and the query heads with their `weights` [H_q]
    (head_weights). Other pages score 0.
    """
    B, T, Hq, D = q.shape
    Hkv, P = k_min.shape[1], k_min.shape[2]
    group = Hq // Hkv
    qf = q.float().view(B, T, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * T, D)  # rows g * T + t
    bound = (qf.clamp_min(0) @ k_max.transpose(-1, -2) + qf.clamp_max(0) @ k_min.transpose(-1, -2)) / math.sqrt(D)
    filled = torch.arange(P, device=q.device)[None, :] * page < lengths.long()[:, None]  # [B, P]
    probs = torch.softmax(bound.masked_fill(~filled[:, None, None], float("-inf")), dim=-1)  # [B, H_kv, G * T, P]
    weight = weights.view(Hkv, group, 1).expand(Hkv, group, T).reshape(1, Hkv, group * T, 1)
    chosen = (probs * weight).sum(dim=(1, 2))  # [B, P]
    return torch.where(filled, chosen.nan_to_num(0.0), 0.0)


class InPassSelector(Selector):
    """Selection layers as a Selector: the set is chosen inside the verification pass (module doc)."""

    def __init__(self, config: DustinConfig, cache: KVCache, target: ModelConfig, lookahead: Lookahead | None,
                 pages: bool = False, m: int | None = None, dense_layers: int | None = None,
                 pdl: bool = False) -> None:
        if not config.selection_layers:
            raise ConfigError("in-pass selection needs selection_layers in the Dustin config (the target layers whose "
                              "verification queries choose the set); run `trtllm-dustin search` for this pair")
        self.m = config.selection_m if m is None else m
        free = config.budget - config.n_sink - config.n_recent
        if not 0 <= self.m <= free:
            raise ConfigError(f"in-pass selection: m={self.m} must be in [0, k - sinks - window = {free}]")
        if self.m > 0 and lookahead is None:
            raise ConfigError("in-pass selection with a lookahead share m > 0 needs the draft's lookahead queries")
        self.cfg, self.cache, self.lookahead, self.pages, self.pdl = config, cache, lookahead, pages, pdl
        self.budget = config.budget
        # the score window before the top-k; page scores already choose whole pages, so pages take none
        self.score_window = (1, "max") if pages else (config.score_window, config.score_window_op)
        self.layers: dict[int, LayerHeads] = {lh.layer: lh for lh in config.selection_layers}
        self.first = config.selection_layers[0].layer
        self.pool: dict[int, LayerHeads] = {lh.layer: lh for lh in config.pool_layers}
        self.dense_layers = frozenset(range(config.dense_layers if dense_layers is None else dense_layers))
        self.selection_layers = frozenset(self.layers) | frozenset(self.pool)  # the pass calls `choose` there
        self.in_pass = self  # the verification pass calls `choose` at the selection layers
        self.target_query_layers = (self.first,)  # the prompt's last query seeds round 1's set
        slots, s_max, device = cache.batch_slots, cache.max_seq_len, cache.seqlens.device
        self.indices = torch.full((slots, config.budget), -1, dtype=torch.int32, device=device)
        self.scores = torch.zeros(slots, s_max, dtype=torch.float32, device=device)
        self.s_draft = torch.zeros(slots, s_max, dtype=torch.float32, device=device) if self.m else None
        self.drafted = torch.zeros(slots, self.m, dtype=torch.long, device=device)  # the lookahead's m positions
        self._positions = torch.arange(s_max, device=device)[None, :]  # [1, S]
        self._sinks = torch.arange(config.n_sink, device=device)[None, :]
        self._recent = torch.arange(config.n_recent, device=device)[None, :] - config.n_recent
        pages_per_seq = -(-s_max // PAGE)
        scored = {**self.pool, **self.layers}  # every layer that scores its queries
        # pages: each scoring layer's per-page key range, fp32 [B, H_kv, P, D] (min, max)
        self.key_range = {layer: (torch.zeros(slots, target.num_kv_heads, pages_per_seq, target.head_dim,
                                              device=device),
                                  torch.zeros(slots, target.num_kv_heads, pages_per_seq, target.head_dim,
                                              device=device)) for layer in scored} if pages else {}
        # pages with pooling: the pooled layers' page scores, summed as the pass goes, fp32 [B, P]
        self.page_scores = torch.zeros(slots, pages_per_seq, device=device) if pages and self.pool else None
        # pages: the last two pages of each slot are refreshed every round (the committed tokens since, <= Γ + 1)
        self._page_offsets = torch.arange(2 * PAGE, device=device)[None, :]
        self._page_pair = torch.arange(2, device=device)[None, :]
        self._head_weights = {layer: head_weights(lh.heads, target.num_heads, device)
                              for layer, lh in scored.items()} if pages else {}
        self._fixed_m = torch.full((slots,), self.m, dtype=torch.long, device=device)

    # ---- the set's parts ------------------------------------------------------------------------------------------
    def _candidates(self, lengths: torch.Tensor) -> torch.Tensor:
        """bool [n, S]: the positions the choice may take, [n_sink, L_b - n_recent) (sinks and recent are kept)."""
        return (self._positions >= self.cfg.n_sink) & (self._positions < lengths.long()[:, None] - self.cfg.n_recent)

    def _assemble(self, lengths: torch.Tensor, scores: torch.Tensor, drafted: torch.Tensor | None) -> torch.Tensor:
        """sinks + the m drafted positions + TopK(scores) over the rest of [n_sink, L_b - n_recent) + recent window,
        in the fixed layout; every position of [0, L_b) while L_b <= k."""
        cfg = self.cfg
        if cfg.budget >= scores.shape[1]:  # every L_b < S_max fits: nothing to choose
            return keep_all_indices(lengths, cfg.budget)
        length = lengths.long()[:, None]
        candidate = self._candidates(lengths)
        parts = [self._sinks.expand(lengths.shape[0], -1)]
        if drafted is not None:
            candidate = candidate.scatter(1, drafted, False)
            parts.append(drafted)
        rest = cfg.budget - cfg.n_sink - cfg.n_recent - self.m
        scores = window_scores(scores, *self.score_window)
        parts.append(torch.topk(scores.masked_fill(~candidate, float("-inf")), rest, dim=1, sorted=False).indices)
        parts.append(length + self._recent)
        chosen = torch.cat(parts, dim=1).to(torch.int32)  # [B, k]: the sparse kernel takes any order
        return torch.where(lengths[:, None] > cfg.budget, chosen, keep_all_indices(lengths, cfg.budget))

    def _score(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, lengths: torch.Tensor,
               rows: slice = slice(None)) -> torch.Tensor:
        """S_l over [0, L_b) of the slots `rows` from their queries q [n, T, H_q, D] at L_b + t: exact Eq. 5 (at the
        first selection layer added to the pooled layers' scores), or the page bounds."""
        out = self.scores[rows]
        pooled = layer == self.first and bool(self.pool)
        if not self.pages:
            return srh_score(q, k_cache, lengths, self.layers[layer].heads, out=out, accumulate=pooled, pdl=self.pdl)
        page_scores = self._page_scores(layer, q, lengths, rows)
        if pooled:
            page_scores = page_scores + self.page_scores[rows]
        expanded = page_scores.repeat_interleave(PAGE, dim=1)[:, : out.shape[1]]
        return out.copy_(expanded.masked_fill(self._positions >= lengths.long()[:, None], 0.0))

    def _page_scores(self, layer: int, q: torch.Tensor, lengths: torch.Tensor, rows: slice) -> torch.Tensor:
        """page_bounds of the layer's queries over its key ranges, fp32 [n, P]."""
        k_min, k_max = self.key_range[layer]
        return page_bounds(q, k_min[rows], k_max[rows], lengths, self._head_weights[layer])

    # ---- the Selector seam ------------------------------------------------------------------------------------------
    def on_prefill(self, view: PrefillView) -> None:
        """Round 1's pre-pass set: chosen by the prompt's last token's query at the first selection layer (exact
        scores, over j < L_b - 1), and for `pages` the key ranges of every page of the new slots."""
        slots, lengths = view.slots, view.lengths
        for layer in self.key_range:
            k_min, k_max = self.key_range[layer]
            low, high = page_key_range(self.cache.k[layer][slots], lengths)
            k_min[slots], k_max[slots] = low, high
        q = view.queries[self.first][:, None]  # [n, 1, H_q, D] at L_b - 1
        scores = srh_score(q, self.cache.k[self.first][slots], lengths - 1, self.layers[self.first].heads)
        self.indices[slots] = self._assemble(lengths, scores, None if self.m == 0 else
                                             self._top_drafted(scores, lengths))

    def _top_drafted(self, s_draft: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The m best positions of [n_sink, L_b - n_recent) by s_draft, int64 [B, m]."""
        cfg = self.cfg
        if cfg.budget >= s_draft.shape[1]:  # the set keeps everything (_assemble): no share to take
            return self.drafted[: lengths.shape[0]]
        candidate = self._candidates(lengths)
        return torch.topk(s_draft.masked_fill(~candidate, float("-inf")), self.m, dim=1, sorted=False).indices

    def estimates(self) -> bool:
        """Only with the lookahead's share (m > 0) or page bounds (their key ranges); else the set is all the pass's."""
        return bool(self.pages) or self.s_draft is not None

    def estimate(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """The lookahead's S_draft (m > 0), and for `pages` the key ranges of each slot's last two pages (the tokens
        committed since the last round)."""
        if self.pages:
            self._refresh_pages(lengths)
        if self.s_draft is None:
            return None
        for i, lh in enumerate(self.cfg.draft_layers):
            srh_score(self.lookahead.queries[lh.layer], self.lookahead.keys[lh.layer], lengths, lh.heads,
                      out=self.s_draft, accumulate=i > 0, pdl=self.pdl)
        return self.s_draft

    def _refresh_pages(self, lengths: torch.Tensor) -> None:
        first_page = (lengths.long() - 1).div(PAGE, rounding_mode="floor").clamp_min(1) - 1  # [B]
        positions = (first_page[:, None] * PAGE + self._page_offsets).clamp_max(self.scores.shape[1] - 1)  # [B, 2P]
        pages = first_page[:, None] + self._page_pair  # [B, 2]
        for layer, (k_min, k_max) in self.key_range.items():
            keys = self.cache.k[layer]  # [B, H_kv, S, D]
            B, H, _, D = keys.shape
            rows = torch.gather(keys, 2, positions[:, None, :, None].expand(B, H, -1, D)).float()  # [B, H, 2P, D]
            valid = (positions < lengths.long()[:, None]).view(B, 1, 2, PAGE, 1)
            low, high = _masked_range(rows.view(B, H, 2, PAGE, D), valid)  # [B, H, 2, D]
            index = pages[:, None, :, None].expand(B, H, 2, D)
            k_min.scatter_(2, index, low)
            k_max.scatter_(2, index, high)

    def select(self, lengths: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """The pre-pass set: the previous choice with the recent window moved to [L_b - 16, L_b); the lookahead's m
        positions are kept for the pass."""
        cfg = self.cfg
        if scores is not None:
            self.drafted.copy_(self._top_drafted(scores, lengths))
        self.indices[:, cfg.budget - cfg.n_recent:] = (lengths.long()[:, None] + self._recent).to(torch.int32)
        self.indices.copy_(torch.where(lengths[:, None] > cfg.budget, self.indices,
                                       keep_all_indices(lengths, cfg.budget)))
        return self.indices

    def choose(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        self._choose(layer, q, k_cache, cache_seqlens, slice(None))

    def rows(self, rows: slice) -> _Rows:
        return _Rows(self, rows)

    def _choose(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, lengths: torch.Tensor, rows: slice) -> None:
        """choose for the slots `rows` (q, k_cache and lengths hold those slots only); a pooled layer only scores."""
        if layer in self.pool:
            first = layer == min(self.pool)
            if self.pages:
                page_scores = self._page_scores(layer, q, lengths, rows)
                if first:
                    self.page_scores[rows] = page_scores
                else:
                    self.page_scores[rows] += page_scores
            else:
                srh_score(q, k_cache, lengths, self.pool[layer].heads, out=self.scores[rows], accumulate=not first,
                          pdl=self.pdl)
            return
        scores = self._score(layer, q, k_cache, lengths, rows)
        self.indices[rows] = self._assemble(lengths, scores, self.drafted[rows] if self.m else None)

    def observe(self, seen: Observation) -> None:
        """Nothing: the pass leaves its choice in `indices`, which the next round's pre-pass starts from."""

    def draft_share(self) -> torch.Tensor:
        return self._fixed_m


class _Rows:
    """An InPassSelector's selection over some batch slots only (InPassSelection.rows)."""

    def __init__(self, selector: InPassSelector, rows: slice) -> None:
        self.selector, self.slots = selector, rows
        self.dense_layers, self.selection_layers = selector.dense_layers, selector.selection_layers

    def choose(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
        self.selector._choose(layer, q, k_cache, cache_seqlens, self.slots)

    def rows(self, rows: slice) -> _Rows:
        start = (self.slots.start or 0) + (rows.start or 0)
        stop = start + (rows.stop - (rows.start or 0)) if rows.stop is not None else self.slots.stop
        return _Rows(self.selector, slice(start, stop))
