"""SnapKV as a verification set: chosen once from the prompt, then fixed.

The last `window` prompt tokens' attention to the rest of the prompt, summed over the window's queries and the query
heads of each KV head, max-pooled over positions (kernel 7) per KV head, then summed over KV heads and over every
target layer (the original keeps one set per layer and KV head; the sparse kernel takes one per sequence). The window
and the top prefix positions are fixed for the whole decode; the tokens generated since the prompt always stay, so
as they accumulate they take the budget from the lowest-ranked prompt positions and the set stays exactly k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.plugins.selection import keep_all_indices
from trtllm_dustin.runtime.drafter import PrefillView
from trtllm_dustin.runtime.prefill import slot_range
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation

__all__ = ["WINDOW", "SnapKVSelector", "snapkv_indices", "snapkv_priority", "snapkv_scores"]


def snapkv_scores(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor], window_start: torch.Tensor,
                  prompt_lens: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """SnapKV's prefix importance, one score per position for all layers and heads -> fp32 [B, S].

    queries[l]: [B, w, H_q, D] rotated queries of the prompt positions window_start_b + t (t < w; those >= the prompt
    length L_b are ignored); keys[l]: [B, H_kv, S, D] the same layer's cache. Each query's softmax runs over its causal
    range [0, window_start_b + t]; the probabilities on the prefix [0, window_start_b) are summed over the window's
    queries and the query heads of each KV head, max-pooled over positions per KV head, and summed over KV heads and
    layers. Positions outside the prefix score 0.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"snapkv: pooling kernel {kernel} must be odd and >= 1")
    start, lens = window_start.long(), prompt_lens.long()
    total = None
    for q, k in zip(queries, keys, strict=True):
        B, w, Hq, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        qg = q.float().view(B, w, Hkv, Hq // Hkv, D)  # [B, w, H_kv, G, D]
        logits = torch.einsum("btkgd,bksd->bkgts", qg, k.float()) / math.sqrt(D)  # [B, H_kv, G, w, S]
        q_pos = start[:, None] + torch.arange(w, device=q.device)[None, :]  # [B, w]
        visible = torch.arange(S, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, w, S]
        probs = torch.softmax(logits.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)
        probs = probs * (q_pos < lens[:, None])[:, None, None, :, None]  # queries past the prompt: padding
        prefix = torch.arange(S, device=q.device)[None, :] < start[:, None]  # [B, S]
        per_kv_head = probs.sum(dim=(2, 3)) * prefix[:, None]  # [B, H_kv, S]
        pooled = F.max_pool1d(per_kv_head, kernel, stride=1, padding=kernel // 2)  # [B, H_kv, S]
        layer_score = pooled.sum(1) * prefix  # [B, S]
        total = layer_score if total is None else total + layer_score
    if total is None:
        raise ValueError("snapkv: no layers given")
    return total


def snapkv_priority(scores: torch.Tensor, window_start: torch.Tensor, prompt_lens: torch.Tensor,
                    budget: int) -> torch.Tensor:
    """The prompt positions SnapKV keeps, best first -> int32 [B, budget] (-1 past the prompt's length).

    The observation window [window_start_b, L_b) comes first, most recent first; then the prefix by score (ties:
    lower position first).
    """
    S = scores.shape[1]
    positions = torch.arange(S, device=scores.device)[None, :]
    window_key = scores.amax(dim=1, keepdim=True) + 1 + positions  # above every prefix score; later is better
    key = torch.where(positions >= window_start.long()[:, None], window_key, scores.float())
    key = key.masked_fill(positions >= prompt_lens.long()[:, None], float("-inf"))
    # Pooling gives neighbours of one peak equal scores: a stable sort breaks the ties by position, lowest first.
    ranked = torch.sort(key, dim=1, descending=True, stable=True)
    n = min(budget, S)
    chosen = torch.where(torch.isfinite(ranked.values[:, :n]), ranked.indices[:, :n], -1).to(torch.int32)
    return F.pad(chosen, (0, budget - n), value=-1)


def snapkv_indices(priority: torch.Tensor, prompt_lens: torch.Tensor, seqlens: torch.Tensor,
                   budget: int) -> torch.Tensor:
    """SnapKV's set at length L_b: the n_gen = min(L_b - prompt_b, k) newest positions plus the first k - n_gen
    of `priority` -> int32 [B, budget] sorted, -1 padded."""
    slots = torch.arange(budget, device=seqlens.device)[None, :]
    lengths = seqlens.long()[:, None]
    n_gen = (lengths - prompt_lens.long()[:, None]).clamp(0, budget)  # [B, 1]
    # When L_b > k the first k - n_gen priorities are valid prompt positions: k - n_gen < prompt_b.
    chosen = torch.where(slots < budget - n_gen, priority.long(), lengths - budget + slots)
    chosen = chosen.sort(dim=1).values.to(torch.int32)
    return torch.where(seqlens[:, None] > budget, chosen, keep_all_indices(seqlens, budget))


WINDOW = 32  # the observation window: the last prompt tokens whose attention ranks the rest (SnapKV's default)


class SnapKVSelector(Selector):
    """SnapKV's set per slot: ranked when the slot's prompt is admitted, then fixed (see the module doc)."""

    target_query_layers: tuple[int, ...] = ()

    def __init__(self, budget: int, n_sink: int, target: Transformer, cache: KVCache, backend: AttentionBackend,
                 window: int = WINDOW, kernel: int = 7) -> None:
        if not 0 <= n_sink < budget:
            raise ConfigError(f"snapkv: n_sink={n_sink} must lie in [0, budget k={budget})")
        if not 1 <= window < budget:
            raise ConfigError(f"snapkv: observation window {window} must lie in [1, budget k={budget})")
        if window > cache.max_seq_len:
            raise ConfigError(f"snapkv: observation window {window} exceeds --max-seq-len {cache.max_seq_len}")
        self.budget, self.n_sink, self.window, self.kernel = budget, n_sink, window, kernel
        self.in_pass = None  # the set is fixed at the prompt
        self.target, self.cache, self.backend = target, cache, backend
        slots, device = cache.batch_slots, cache.seqlens.device
        self.prompt_lens = torch.ones(slots, dtype=torch.int32, device=device)  # idle slots run along at 1
        self.priority = torch.full((slots, budget), -1, dtype=torch.int32, device=device)
        self.indices = torch.full((slots, budget), -1, dtype=torch.int32, device=device)

    def window_queries(self, slots: slice, prompts: Sequence[Sequence[int]]
                       ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Every target layer's queries of the prompts' last `window` tokens ([n, w, H_q, D]) and the window starts.

        Prefill keeps only the last token's query, so the window is run through the target once more at its own
        positions; that rewrites the window's K/V, which are put back afterwards so the cache is prefill's, bit for
        bit. Positions past a prompt shorter than the window are padding.
        """
        n, w, cfg, device = len(prompts), self.window, self.target.config, self.cache.seqlens.device
        view = slot_range(self.cache, slots)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
        start = (lens - w).clamp_min(0)
        tokens = torch.zeros(n, w, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            piece = p[max(len(p) - w, 0):]
            tokens[b, : len(piece)] = torch.as_tensor(piece, dtype=torch.long)
        positions = start.long()[:, None] + torch.arange(w, device=device)[None, :]  # [n, w]
        gather = positions[None, :, None, :, None].expand(cfg.num_layers, n, cfg.num_kv_heads, w, cfg.head_dim)
        saved_k, saved_v = view.k.gather(3, gather), view.v.gather(3, gather)
        layers = tuple(range(cfg.num_layers))
        dtype = self.target.embed.weight.dtype  # the model's: the cache may be fp8
        capture = QueryCapture(layers, {layer: torch.empty(n, w, cfg.num_heads, cfg.head_dim, dtype=dtype,
                                                           device=device) for layer in layers})
        meta = AttentionMetadata(cache_seqlens=start, max_kv_len=max(len(p) for p in prompts) + w)
        self.target(tokens, view, meta, self.backend, logit_index=torch.zeros(n, dtype=torch.long, device=device),
                    capture=capture)
        view.k.scatter_(3, gather, saved_k)
        view.v.scatter_(3, gather, saved_v)
        return capture.queries, start

    def on_prefill(self, view: PrefillView) -> None:
        queries, start = self.window_queries(view.slots, view.prompts)
        cache = slot_range(self.cache, view.slots)
        layers = sorted(queries)
        scores = snapkv_scores([queries[layer] for layer in layers], [cache.k[layer] for layer in layers], start,
                               view.lengths, self.kernel)
        self.prompt_lens[view.slots] = view.lengths
        self.priority[view.slots] = snapkv_priority(scores, start, view.lengths, self.budget)

    def estimates(self) -> bool:
        return False

    def estimate(self, lengths: torch.Tensor) -> None:
        return None

    def select(self, lengths: torch.Tensor, scores: None) -> torch.Tensor:
        self.indices.copy_(snapkv_indices(self.priority, self.prompt_lens, lengths, self.budget))
        return self.indices

    def observe(self, seen: Observation) -> None:
        """The set is fixed at the prompt; nothing kept."""

    def draft_share(self) -> None:
        return None
