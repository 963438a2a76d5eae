"""Verification-set selection (paper Eq. 6) and the StreamingLLM set of MagicDec's draft.

Both return int32 [B, budget]: valid cache positions sorted ascending, then -1 padding, the
`indices` layout sparse_verify_attention takes. Fixed shapes and no host sync, so they run inside
a captured decode round; checks read only Python ints.

Eq. 6 runs as one Triton kernel (one program per sequence) on CUDA: in torch it is two top-k's,
a scatter, a concatenation and a sort, about 35 launches and 0.23 ms a round at B = 16, 32K on the
H200. The kernel finds each top-k's threshold by a radix select over the scores' sortable bit
patterns (four 8-bit digits, one histogram pass each), then writes the chosen positions in order
in one compaction pass, so nothing is sorted. Ties at a threshold go to the lowest positions;
`select_verify_indices_ref` (torch.topk) may take other tied positions, which Eq. 6 allows too.
"""

import os

import torch
import triton
import triton.language as tl

from .split_kv import runs_triton

__all__ = ["keep_all_indices", "select_verify_indices", "select_verify_indices_ref", "streaming_indices"]

SELECT_BLOCK = 2048  # scores per step of the kernel's passes: 8 per thread at 8 warps


def keep_all_indices(cache_seqlens: torch.Tensor, budget: int) -> torch.Tensor:
    """int32 [B, budget]: 0 .. L_b - 1 then -1 (the set of a context that fits in the budget)."""
    positions = torch.arange(budget, device=cache_seqlens.device, dtype=torch.int32)[None, :]
    return torch.where(positions < cache_seqlens[:, None], positions, -1)


def _check_seqlens(op: str, cache_seqlens: torch.Tensor) -> None:
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: cache_seqlens is {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}; "
                         "expected int32 [B]")


@triton.jit
def _sortable(x):
    """fp32 -> uint32 that orders like the value (-0.0 equals 0.0; NaN above +inf, as torch.topk ranks it)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _taken(row, pos, ok, threshold, need, ties_before):
    """Which of `pos` a selection (threshold, need) over `row` took: keys above the threshold, and the first `need`
    positions whose key equals it, counting `ties_before` earlier ones. Returns (taken, ties including these)."""
    key = _sortable(tl.load(row + pos, mask=ok, other=0.0))
    tie = ok & (key == threshold)
    rank = ties_before + tl.cumsum(tie.to(tl.int32), 0) - 1
    taken = ok & ((key > threshold) | (tie & (rank < need)))
    return taken, ties_before + tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _threshold(row, ex_row, lo, hi, k, ex_threshold, ex_need, EXCLUDE: tl.constexpr, BLOCK: tl.constexpr):
    """Radix select: the k-th largest key of row[lo:hi] (less the positions the (ex_threshold, ex_need) selection of
    ex_row took, when EXCLUDE). Returns (threshold, need): the top k are the keys above the threshold plus the first
    `need` positions at it. k = 0 selects nothing."""
    bins = tl.arange(0, 512)  # digits 0..255; 256 collects the positions that do not take part
    prefix = tl.full([], 0, tl.uint32)
    known = tl.full([], 0, tl.uint32)  # bits of the threshold fixed so far
    k_left = tl.maximum(k, 1)
    for r in tl.static_range(4):
        shift = 24 - 8 * r
        hist = tl.zeros([512], dtype=tl.int32)
        ex_ties = 0
        for start in range(lo, hi, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            ok = pos < hi
            key = _sortable(tl.load(row + pos, mask=ok, other=0.0))
            if EXCLUDE:
                taken, ex_ties = _taken(ex_row, pos, ok, ex_threshold, ex_need, ex_ties)
                ok = ok & ~taken
            ok = ok & ((key & known) == prefix)
            hist += tl.histogram(tl.where(ok, ((key >> shift) & 0xFF).to(tl.int32), 256), 512)
        hist = tl.where(bins < 256, hist, 0)
        above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys with a larger digit than d
        digit = tl.max(tl.where((above < k_left) & (above + hist >= k_left), bins, -1), 0)
        k_left -= tl.sum(tl.where(bins == digit, above, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
        known = known | tl.full([], 0xFF << shift, tl.uint32)
    none = k <= 0
    return tl.where(none, 0xFFFFFFFF, prefix).to(tl.uint32), tl.where(none, 0, k_left)


@triton.jit
def _select_verify_kernel(
    sd_ptr, st_ptr, m_ptr, seqlens_ptr, out_ptr, stride_sd, stride_st, stride_out,
    budget, n_sink, n_recent, m_all, M_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    length = tl.load(seqlens_ptr + b)
    out_row = out_ptr + b.to(tl.int64) * stride_out
    offs = tl.arange(0, BLOCK)
    if length <= budget:  # everything fits: 0 .. L-1, then -1
        for start in range(0, budget, BLOCK):
            pos = start + offs
            tl.store(out_row + pos, tl.where(pos < length, pos, -1), mask=pos < budget)
    else:
        free = budget - n_sink - n_recent
        if M_PER_ROW:
            m = tl.minimum(tl.maximum(tl.load(m_ptr + b), 0), free)
        else:
            m = m_all
        lo = n_sink
        hi = length - n_recent  # candidates: [n_sink, L - n_recent)
        sd_row = sd_ptr + b.to(tl.int64) * stride_sd
        st_row = st_ptr + b.to(tl.int64) * stride_st
        d_threshold, d_need = _threshold(sd_row, sd_row, lo, hi, m, 0, 0, EXCLUDE=False, BLOCK=BLOCK)
        t_threshold, t_need = _threshold(st_row, sd_row, lo, hi, free - m, d_threshold, d_need, EXCLUDE=True,
                                         BLOCK=BLOCK)
        # One ordered pass over [0, L): sinks, window, the draft's and the target's picks, written in position order.
        written = 0
        d_ties = 0
        t_ties = 0
        for start in range(0, length, BLOCK):
            pos = start + offs
            in_ctx = pos < length
            candidate = in_ctx & (pos >= lo) & (pos < hi)
            by_draft, d_ties = _taken(sd_row, pos, candidate, d_threshold, d_need, d_ties)
            by_target, t_ties = _taken(st_row, pos, candidate & ~by_draft, t_threshold, t_need, t_ties)
            chosen = (in_ctx & ~candidate) | by_draft | by_target
            slot = written + tl.cumsum(chosen.to(tl.int32), 0) - 1
            tl.store(out_row + slot, pos, mask=chosen)
            written += tl.sum(chosen.to(tl.int32), 0)


def select_verify_forward(s_draft: torch.Tensor, s_target: torch.Tensor, cache_seqlens: torch.Tensor,
                          m_rows: torch.Tensor | None, m: int, budget: int, n_sink: int, n_recent: int,
                          out: torch.Tensor) -> None:
    """Launch the Eq. 6 kernel (inputs already validated).

    Launch contract:
      s_draft, s_target: fp32 [B, S_max], last dim contiguous; entries at j >= L_b are not read
      cache_seqlens: int32 [B], L_b <= S_max; m_rows: int32 [B] per-sequence m (clamped to [0, free]) or None
      m: the batch's m when m_rows is None, 0 <= m <= free = budget - n_sink - n_recent
      out: int32 [B, budget], last dim contiguous (written): the chosen positions ascending, -1 padded
      grid: (B,); a program walks its row in steps of SELECT_BLOCK, 9 passes over the candidates
    """
    batch = s_draft.shape[0]
    if batch == 0:
        return
    _select_verify_kernel[(batch,)](
        s_draft, s_target, m_rows if m_rows is not None else cache_seqlens, cache_seqlens, out,
        s_draft.stride(0), s_target.stride(0), out.stride(0), budget, n_sink, n_recent, m,
        M_PER_ROW=m_rows is not None, BLOCK=SELECT_BLOCK, num_warps=8)


@torch.library.custom_op("trtllm_dustin::select_verify_indices", mutates_args=())
def _select_verify_op(s_draft: torch.Tensor, s_target: torch.Tensor, cache_seqlens: torch.Tensor,
                      m_rows: torch.Tensor | None, budget: int, m: int, n_sink: int, n_recent: int) -> torch.Tensor:
    out = torch.empty(s_draft.shape[0], budget, dtype=torch.int32, device=s_draft.device)
    select_verify_forward(s_draft, s_target, cache_seqlens, m_rows, m, budget, n_sink, n_recent, out)
    return out


@_select_verify_op.register_fake
def _(s_draft, s_target, cache_seqlens, m_rows, budget, m, n_sink, n_recent) -> torch.Tensor:
    return s_draft.new_empty(s_draft.shape[0], budget, dtype=torch.int32)


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
    if not runs_triton(s_draft) or os.environ.get("TRTLLM_DUSTIN_ROUND_KERNELS", "1") == "0":
        return select_verify_indices_ref(s_draft, s_target, cache_seqlens, budget, m, n_sink, n_recent)
    m_rows = m.to(device=s_draft.device, dtype=torch.int32).contiguous() if per_sequence else None
    return _select_verify_op(s_draft.float().contiguous(), s_target.float().contiguous(), cache_seqlens.contiguous(),
                             m_rows, budget, m_checked, n_sink, n_recent)


def select_verify_indices_ref(s_draft: torch.Tensor, s_target: torch.Tensor, cache_seqlens: torch.Tensor,
                              budget: int, m: int | torch.Tensor, n_sink: int = 4, n_recent: int = 16) -> torch.Tensor:
    """`select_verify_indices` in torch ops (inputs already validated; budget < S_max)."""
    batch, s_max = s_draft.shape
    per_sequence = isinstance(m, torch.Tensor)
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
