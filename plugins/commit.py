"""Committing a speculative round in one launch: append the accepted tokens, cut at EOS and each row's token
limit, advance the target cache's lengths and the round-loop state.

In torch the commit is about 25 small kernels a round, launched eagerly between the captured phases; here one
program holds the whole batch (a round has B x (Γ + 1) tokens), so the per-round histogram needs no atomics
and the result does not depend on scheduling. `commit_round_ref` is the torch code, used on the CPU and by
the tests. Γ = 0 (no drafts) is plain decoding: the round commits the target's token alone.
"""

import torch
import triton
import triton.language as tl

from .launch import launch_table
from .split_kv import runs_triton

__all__ = ["MAX_COMMIT_ROWS", "commit_round", "commit_round_forward", "commit_round_ref"]

MAX_COMMIT_ROWS = 4096  # one program holds every row's [Γ + 1] tokens in registers


def commit_round_ref(draft_tokens: torch.Tensor, verify_tokens: torch.Tensor, accepted: torch.Tensor,
                     nxt: torch.Tensor, eos: torch.Tensor, limits: torch.Tensor, out: torch.Tensor,
                     active: torch.Tensor, generated: torch.Tensor, hist: torch.Tensor, prev: torch.Tensor,
                     cur: torch.Tensor, seqlens: torch.Tensor) -> None:
    """See `commit_round`; torch ops, in place."""
    gamma = draft_tokens.shape[1]
    positions = torch.arange(gamma + 1, device=draft_tokens.device)
    round_tokens = torch.cat([draft_tokens, nxt[:, None]], dim=1)
    round_tokens.scatter_(1, accepted[:, None], nxt[:, None])  # [B, Γ+1]; past a+1: junk
    committed = accepted + 1
    is_eos = torch.isin(round_tokens, eos) & (positions[None] < committed[:, None])
    first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), gamma + 1)
    keep = torch.minimum(torch.minimum(committed, first_eos + 1), limits - generated).clamp_min(0)
    keep = torch.where(active, keep, 0)
    junk = out.shape[1] - 1  # cut tokens land in the last column
    cols = torch.where(positions[None] < keep[:, None], generated[:, None] + positions[None], junk)
    out.scatter_(1, cols, round_tokens)
    hist.scatter_add_(0, accepted, active.long())
    prev.copy_(torch.where(active, verify_tokens.gather(1, accepted[:, None])[:, 0], prev))
    cur.copy_(torch.where(active, nxt, cur))
    seqlens.add_(keep.int())
    generated += keep
    active &= ~(is_eos.any(1) | (generated >= limits))


@triton.jit
def _commit_round_kernel(
    draft_ptr, verify_ptr, accepted_ptr, nxt_ptr, eos_ptr, limits_ptr, out_ptr, active_ptr, generated_ptr, hist_ptr,
    prev_ptr, cur_ptr, seqlens_ptr,
    batch, n_eos, stride_draft, stride_verify, stride_out,
    GAMMA: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_T)
    row_ok = rows < batch
    accepted = tl.load(accepted_ptr + rows, mask=row_ok, other=0)
    nxt = tl.load(nxt_ptr + rows, mask=row_ok, other=0)
    active = (tl.load(active_ptr + rows, mask=row_ok, other=0) != 0) & row_ok
    generated = tl.load(generated_ptr + rows, mask=row_ok, other=0)
    limit = tl.load(limits_ptr + rows, mask=row_ok, other=0)
    # The round's tokens: the drafts with the target's token at position a (Γ+1 columns, the first a+1 count).
    drafts = tl.load(draft_ptr + rows[:, None] * stride_draft + cols[None, :],
                     mask=row_ok[:, None] & (cols[None, :] < GAMMA), other=0)
    tokens = tl.where(cols[None, :] == accepted[:, None], nxt[:, None], drafts)
    committed = accepted + 1
    is_eos = tl.zeros([BLOCK_B, BLOCK_T], dtype=tl.int1)
    for e in range(n_eos):
        is_eos = is_eos | (tokens == tl.load(eos_ptr + e))
    is_eos = is_eos & (cols[None, :] < committed[:, None])
    first_eos = tl.min(tl.where(is_eos, cols[None, :], GAMMA + 1), axis=1)
    keep = tl.maximum(tl.minimum(tl.minimum(committed, first_eos + 1), limit - generated), 0)
    keep = tl.where(active, keep, 0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + generated[:, None] + cols[None, :], tokens,
             mask=row_ok[:, None] & (cols[None, :] < keep[:, None]))
    # hist[n] += active sequences that accepted n drafts
    counts = tl.sum(((accepted[:, None] == cols[None, :]) & active[:, None]).to(tl.int32), axis=0).to(tl.int64)
    hist = tl.load(hist_ptr + cols, mask=cols <= GAMMA, other=0)
    tl.store(hist_ptr + cols, hist + counts, mask=cols <= GAMMA)
    # prev: the token at the new L - 1 (verify_tokens[a]); cur: the target's token at L
    last = tl.load(verify_ptr + rows * stride_verify + accepted, mask=row_ok, other=0)
    tl.store(prev_ptr + rows, tl.where(active, last, tl.load(prev_ptr + rows, mask=row_ok, other=0)), mask=row_ok)
    tl.store(cur_ptr + rows, tl.where(active, nxt, tl.load(cur_ptr + rows, mask=row_ok, other=0)), mask=row_ok)
    length = tl.load(seqlens_ptr + rows, mask=row_ok, other=0) + keep.to(tl.int32)
    tl.store(seqlens_ptr + rows, length, mask=row_ok)
    generated = generated + keep
    tl.store(generated_ptr + rows, generated, mask=row_ok)
    done = (first_eos <= GAMMA) | (generated >= limit)
    tl.store(active_ptr + rows, (active & ~done).to(tl.int8), mask=row_ok)


def commit_round_forward(draft_tokens: torch.Tensor, verify_tokens: torch.Tensor, accepted: torch.Tensor,
                         nxt: torch.Tensor, eos: torch.Tensor, limits: torch.Tensor, out: torch.Tensor,
                         active: torch.Tensor, generated: torch.Tensor, hist: torch.Tensor, prev: torch.Tensor,
                         cur: torch.Tensor, seqlens: torch.Tensor) -> None:
    """Launch the commit kernel (inputs already validated).

    Launch contract (B rows, Γ >= 0 drafts, E end ids, W + 1 = out.shape[1]):
      draft_tokens [B, Γ], verify_tokens [B, Γ+1] (cur, then the drafts), accepted [B] in [0, Γ], nxt [B],
      eos [E >= 1]: int64, last dim contiguous
      limits [B] int64 (<= W), out [B, W + 1] int64, generated [B] int64 (<= limits), hist [Γ+1] int64,
      prev / cur [B] int64, active [B] bool, seqlens [B] int32: contiguous; all but limits updated in place
      grid: (1,); the program covers next_pow2(B) x next_pow2(Γ+1); only out[b, generated[b]:][:keep] is written
    """
    batch, gamma = draft_tokens.shape
    if batch == 0:
        return
    _commit_round_kernel[(1,)](
        draft_tokens, verify_tokens, accepted, nxt, eos, limits, out, active.view(torch.int8), generated, hist, prev,
        cur, seqlens, batch, eos.numel(), draft_tokens.stride(0), verify_tokens.stride(0), out.stride(0),
        GAMMA=gamma, BLOCK_B=triton.next_power_of_2(batch), BLOCK_T=triton.next_power_of_2(gamma + 1),
        num_warps=launch_table(out.device).commit.num_warps)


@torch.library.custom_op("trtllm_dustin::commit_round", mutates_args=(
    "out", "active", "generated", "hist", "prev", "cur", "seqlens"))
def _commit_round_op(draft_tokens: torch.Tensor, verify_tokens: torch.Tensor, accepted: torch.Tensor,
                     nxt: torch.Tensor, eos: torch.Tensor, limits: torch.Tensor, out: torch.Tensor,
                     active: torch.Tensor, generated: torch.Tensor, hist: torch.Tensor, prev: torch.Tensor,
                     cur: torch.Tensor, seqlens: torch.Tensor) -> None:
    run = commit_round_forward if runs_triton(draft_tokens) else commit_round_ref
    run(draft_tokens, verify_tokens, accepted, nxt, eos, limits, out, active, generated, hist, prev, cur, seqlens)


def commit_round(draft_tokens: torch.Tensor, verify_tokens: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor,
                 eos: torch.Tensor, limits: torch.Tensor, out: torch.Tensor, active: torch.Tensor,
                 generated: torch.Tensor, hist: torch.Tensor, prev: torch.Tensor, cur: torch.Tensor,
                 seqlens: torch.Tensor, *, use_kernel: bool = True) -> None:
    """Commit a round for every active row b, in place:

    the round's tokens are draft_tokens[b, :a] then nxt[b] (a = accepted[b]); the first a + 1 are kept up to and
    including the first id in `eos`, and at most limits[b] - generated[b] (none once generated[b] >= limits[b]),
    written to out[b, generated[b]:]; hist[a] += 1; prev[b] = verify_tokens[b, a], cur[b] = nxt[b]; seqlens (the
    target cache's committed lengths) and generated grow by what was kept; a row that kept an end id or reached its
    limit turns inactive. Inactive rows change nothing. Γ = 0 (draft_tokens [B, 0], verify_tokens [B, 1], accepted
    0) is a plain decode step: nxt alone is committed.

    Shapes: draft_tokens [B, Γ], verify_tokens [B, Γ+1], accepted / nxt / generated / prev / cur / limits [B],
    eos [E >= 1] (pass [-1] for none), hist [Γ+1]: int64; active bool [B]; seqlens int32 [B]; out int64 [B, W + 1]
    with W >= max(limits) (the last column takes the writes of cut tokens; not checked, that would sync the host).
    use_kernel=False (KernelConfig.round_kernels) runs the torch reference instead of the kernel.
    """
    op = "commit_round"
    if draft_tokens.dim() != 2:
        raise ValueError(f"{op}: draft_tokens has shape {tuple(draft_tokens.shape)}; expected [B, gamma]")
    batch, gamma = draft_tokens.shape
    if batch > MAX_COMMIT_ROWS:
        raise ValueError(f"{op}: {batch} rows is above the kernel's {MAX_COMMIT_ROWS}; commit in slices of rows")
    expect = {"verify_tokens": (verify_tokens, (batch, gamma + 1), torch.int64),
              "accepted": (accepted, (batch,), torch.int64), "nxt": (nxt, (batch,), torch.int64),
              "limits": (limits, (batch,), torch.int64),
              "active": (active, (batch,), torch.bool), "generated": (generated, (batch,), torch.int64),
              "hist": (hist, (gamma + 1,), torch.int64), "prev": (prev, (batch,), torch.int64),
              "cur": (cur, (batch,), torch.int64), "seqlens": (seqlens, (batch,), torch.int32)}
    if draft_tokens.dtype != torch.int64:
        raise TypeError(f"{op}: draft_tokens dtype {draft_tokens.dtype}; expected torch.int64")
    for name, (t, shape, dtype) in expect.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{op}: {name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {list(shape)}")
    if eos.dim() != 1 or eos.numel() == 0 or eos.dtype != torch.int64:
        raise ValueError(f"{op}: eos is {eos.dtype} {tuple(eos.shape)}; expected int64 [E >= 1] (pass [-1] for none)")
    if out.dim() != 2 or out.shape[0] != batch or out.shape[1] < 2 or out.dtype != torch.int64:
        raise ValueError(f"{op}: out is {out.dtype} {tuple(out.shape)}; expected int64 [{batch}, W + 1] with "
                         "W >= max(limits) (the last column takes the writes of cut tokens)")
    tensors = (draft_tokens, verify_tokens, accepted, nxt, eos, limits, out, active, generated, hist, prev, cur,
               seqlens)
    if any(t.device != draft_tokens.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on {draft_tokens.device}")
    state = (limits, *tensors[7:])  # out only needs a contiguous last dim
    if any(t.stride(-1) != 1 for t in tensors) or any(not t.is_contiguous() for t in state):
        raise ValueError(f"{op}: the token tensors need a contiguous last dim and limits and the state tensors must "
                         "be contiguous (call .contiguous() on the inputs; state is updated in place)")
    run = _commit_round_op if use_kernel else commit_round_ref
    run(*tensors)
