"""Verification-set selection (paper Eq. 6) and the StreamingLLM set of MagicDec's draft.

Both return int32 [B, budget]: valid cache positions sorted ascending, then -1 padding, the
`indices` layout sparse_verify_attention takes. Pure torch with fixed shapes (topk, masking,
sort): no host sync, so they run inside a captured decode round. Checks read only Python ints.
"""

import torch

__all__ = ["keep_all_indices", "select_verify_indices", "streaming_indices", "window_scores"]


def keep_all_indices(cache_seqlens: torch.Tensor, budget: int) -> torch.Tensor:
    """int32 [B, budget]: 0 .. L_b - 1 then -1 (the set of a context that fits in the budget)."""
    positions = torch.arange(budget, device=cache_seqlens.device, dtype=torch.int32)[None, :]
    return torch.where(positions < cache_seqlens[:, None], positions, -1)


def window_scores(scores: torch.Tensor, width: int, op: str = "max") -> torch.Tensor:
    """fp32 [B, S] -> [B, S]: each position's score replaced by the max ("max", SnapKV's pooling) or the mean ("mean")
    of the scores in the window of odd `width` centred on it (positions past either end count as absent for the max and
    as 0 for the mean); width 1 returns `scores` itself.

    Before a top-k this makes a chosen position bring its neighbours. Callers mask the positions that may not be chosen
    after the window, so a score spreads into the sinks or past L_b harmlessly.
    """
    if width < 1 or width % 2 == 0:
        raise ValueError(f"window_scores: width {width} must be odd and >= 1")
    if width == 1:
        return scores
    rows = scores[:, None, :]  # [B, 1, S]: the pooling ops' channel layout
    if op == "max":
        return torch.nn.functional.max_pool1d(rows, width, stride=1, padding=width // 2)[:, 0]
    if op == "mean":
        return torch.nn.functional.avg_pool1d(rows, width, stride=1, padding=width // 2)[:, 0]
    raise ValueError(f"window_scores: op {op!r} is unknown; choose max or mean")


def _check_seqlens(op: str, cache_seqlens: torch.Tensor) -> None:
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: cache_seqlens is {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}; "
                         "expected int32 [B]")


def select_verify_indices(s_draft: torch.Tensor, s_target: torch.Tensor, cache_seqlens: torch.Tensor, budget: int,
                          m: int | torch.Tensor, n_sink: int = 4, n_recent: int = 16) -> torch.Tensor:
    """Eq. 6: I_verify = sinks + recent window + TopK(S_draft, m) + TopK(S_target, rest).

    s_draft, s_target: fp32 [B, S_max] importance (srh_score output; entries j >= L_b ignored);
    cache_seqlens: int32 [B] committed lengths L_b. Sequences with L_b <= budget keep all of
    [0, L_b). Otherwise: the first n_sink and last n_recent positions of [0, L_b), the m best
    remaining by s_draft, then the budget - m - n_sink - n_recent best of what is left by s_target.
    m: one int for the batch, or an integer tensor [B] of per-sequence shares (clamped to
    [0, budget - n_sink - n_recent]; row b then equals the call with m = m[b] on that row alone).
    Returns int32 [B, budget], sorted ascending, -1 padded.
    """
    op = "select_verify_indices"
    _check_seqlens(op, cache_seqlens)
    per_sequence = isinstance(m, torch.Tensor)
    m_checked = 0 if per_sequence else m
    if min(m_checked, n_sink, n_recent) < 0:
        raise ValueError(f"{op}: m={m}, n_sink={n_sink}, n_recent={n_recent} must be >= 0")
    if budget < n_sink + n_recent + m_checked:
        raise ValueError(f"{op}: budget {budget} is smaller than n_sink + n_recent + m = "
                         f"{n_sink + n_recent + m_checked}; raise the budget or lower m")
    if s_draft.dim() != 2 or s_draft.shape != s_target.shape or s_draft.shape[0] != cache_seqlens.shape[0]:
        raise ValueError(f"{op}: s_draft {tuple(s_draft.shape)} and s_target {tuple(s_target.shape)} must both be "
                         f"[B={cache_seqlens.shape[0]}, S_max]")
    if per_sequence and tuple(m.shape) != (cache_seqlens.shape[0],):
        raise ValueError(f"{op}: per-sequence m has shape {tuple(m.shape)}; expected [B={cache_seqlens.shape[0]}]")
    batch, s_max = s_draft.shape
    if budget >= s_max:  # every L_b < S_max fits: nothing to choose
        return keep_all_indices(cache_seqlens, budget)

    device = s_draft.device
    lengths = cache_seqlens.long()[:, None]  # [B, 1]
    positions = torch.arange(s_max, device=device)[None, :]  # [1, S]
    # When L_b > budget >= n_sink + n_recent the sink and window sets are disjoint and inside [0, L_b).
    sinks = torch.arange(n_sink, device=device)[None, :].expand(batch, n_sink)
    recent = lengths - n_recent + torch.arange(n_recent, device=device)[None, :]  # [B, n_recent]
    candidate = (positions < lengths) & (positions >= n_sink) & (positions < lengths - n_recent)
    free = budget - n_sink - n_recent
    if per_sequence:  # the top `free` of each source, of which row b keeps m_b and free - m_b: fixed shapes
        slots = torch.arange(free, device=device)[None, :]
        m_b = m.long().clamp(0, free)[:, None]  # [B, 1]
        draft = torch.topk(s_draft.float().masked_fill(~candidate, float("-inf")), free, dim=1).indices
        take_draft = slots < m_b
        candidate = candidate & ~torch.zeros_like(candidate).scatter(1, draft, take_draft)
        target = torch.topk(s_target.float().masked_fill(~candidate, float("-inf")), free, dim=1).indices
        unused = torch.full_like(draft, s_max)  # sorts after every position, then cut off
        parts = [sinks, recent, torch.where(take_draft, draft, unused), torch.where(slots < free - m_b, target, unused)]
        chosen = torch.cat(parts, dim=1).sort(dim=1).values[:, :budget].to(torch.int32)  # k valid, then the unused
    else:
        # Unsorted: the union is sorted by position below, so the rank order within each top-k is not needed.
        draft = torch.topk(s_draft.float().masked_fill(~candidate, float("-inf")), m, dim=1, sorted=False).indices
        candidate = candidate.scatter(1, draft, False)
        target = torch.topk(s_target.float().masked_fill(~candidate, float("-inf")), free - m, dim=1,
                            sorted=False).indices
        # positions < 2^31: sorting int32 keys is cheaper than int64 ones
        chosen = torch.cat([sinks, recent, draft, target], dim=1).to(torch.int32).sort(dim=1).values  # [B, budget]
    return torch.where(cache_seqlens[:, None] > budget, chosen, keep_all_indices(cache_seqlens, budget))


def streaming_indices(cache_seqlens: torch.Tensor, budget: int, n_sink: int = 4) -> torch.Tensor:
    """StreamingLLM set (MagicDec's draft): the first n_sink and the last budget - n_sink of [0, L_b).

    Returns int32 [B, budget], sorted ascending, -1 padded (all of [0, L_b) when L_b <= budget).
    """
    op = "streaming_indices"
    _check_seqlens(op, cache_seqlens)
    if not 0 <= n_sink <= budget:
        raise ValueError(f"{op}: n_sink {n_sink} must lie in [0, budget={budget}]")
    slots = torch.arange(budget, device=cache_seqlens.device, dtype=torch.int32)[None, :]  # [1, budget]
    window = cache_seqlens[:, None] - budget + slots  # slot i >= n_sink -> L_b - budget + i
    chosen = torch.where(slots < n_sink, slots, window)
    return torch.where(cache_seqlens[:, None] > budget, chosen, keep_all_indices(cache_seqlens, budget))
