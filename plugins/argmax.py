"""Row argmax over a vocabulary: greedy sampling and greedy acceptance.

torch's argmax reduces a [16, 128256] logit block with one thread block per row (16 blocks on a 132-SM H200),
which leaves most of the GPU idle (the measurement: benchmarks/dev/README.md). Here each row is cut into chunks
reduced in parallel (first pass), then one small program per row picks the best chunk (second pass).

Semantics are torch.argmax's on the last dim: the index of the first maximum; any NaN counts as larger than
every number (the first NaN wins); -0.0 equals 0.0. Each element is turned into an int32 key that orders
like the values under those rules, so both passes compare integers and ties keep the lower index.
"""

import torch
import triton
import triton.language as tl

from .launch import launch_table
from .split_kv import runs_triton

__all__ = ["ARGMAX_DTYPES", "argmax_forward", "argmax_last", "argmax_ref"]

ARGMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Columns per first-pass program: 16 fp32 per thread at 8 warps; 128256 columns make 32 chunks a row.
CHUNK = 4096
MAX_CHUNKS = 1024  # second pass holds one row's chunk keys in registers: rows up to 4M columns


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference: torch.argmax over the last dim (int64 [...])."""
    return x.argmax(dim=-1)


@triton.jit
def _order_key(x):
    """fp32 -> int32 that orders like the value: -0.0 equals 0.0, NaN above +inf."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude so larger means larger
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _argmax_chunk_kernel(x_ptr, key_ptr, idx_ptr, stride_x, n_cols, n_chunks, CHUNK: tl.constexpr):
    """Program (row, chunk): the best key of x[row, chunk * CHUNK: ...] and its first column."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    key = tl.where(cols < n_cols, _order_key(x), -0x80000000)  # below every real key, even -inf's
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, cols, n_cols), axis=0)
    tl.store(key_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, first)


@triton.jit
def _argmax_rows_kernel(key_ptr, idx_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr):
    """Program row: the chunk with the best key (the first such chunk holds the first column)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_chunks
    key = tl.load(key_ptr + row * n_chunks + offs, mask=ok, other=-0x80000000)
    idx = tl.load(idx_ptr + row * n_chunks + offs, mask=ok, other=0x7FFFFFFF)
    best = tl.max(key, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(key == best, idx, 0x7FFFFFFF), axis=0).to(tl.int64))


def argmax_forward(x: torch.Tensor, out: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor) -> None:
    """Launch both passes (inputs already validated).

    Launch contract:
      x:    [R, V] bf16 / fp16 / fp32, V >= 1, last dim contiguous, any row stride
      out:  [R] int64 (written): argmax of each row, torch semantics
      keys, idx: [R, cdiv(V, CHUNK)] int32 scratch (written then read)
      grid: first pass (R, cdiv(V, CHUNK)) at 8 warps; second pass (R,)
    """
    rows, n_cols = x.shape
    n_chunks = keys.shape[1]
    if rows == 0:
        return
    choice = launch_table(x.device).argmax
    _argmax_chunk_kernel[(rows, n_chunks)](x, keys, idx, x.stride(0), n_cols, n_chunks, CHUNK=CHUNK,
                                           num_warps=choice.chunk_num_warps)
    _argmax_rows_kernel[(rows,)](keys, idx, out, n_chunks, BLOCK=max(16, triton.next_power_of_2(n_chunks)),
                                 num_warps=choice.rows_num_warps)


@torch.library.custom_op("trtllm_dustin::argmax_last", mutates_args=())
def _argmax_op(x: torch.Tensor) -> torch.Tensor:
    if not runs_triton(x):
        return argmax_ref(x)
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)  # a view when only the last dim is known contiguous and the rest collapse
    n_chunks = triton.cdiv(n_cols, CHUNK)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    keys = torch.empty(rows.shape[0], n_chunks, dtype=torch.int32, device=x.device)
    idx = torch.empty_like(keys)
    argmax_forward(rows, out, keys, idx)
    return out.view(x.shape[:-1])


@_argmax_op.register_fake
def _(x) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


def argmax_last(x: torch.Tensor, *, use_kernel: bool = True) -> torch.Tensor:
    """x.argmax(dim=-1) for logits x [..., V] in bf16 / fp16 / fp32 (int64 [...]); other dtypes, and
    use_kernel=False (KernelConfig.round_kernels), run torch's."""
    op = "argmax_last"
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} has no last dim to reduce; pass [..., V] with V >= 1")
    if x.dtype not in ARGMAX_DTYPES or not use_kernel:
        return argmax_ref(x)
    if triton.cdiv(x.shape[-1], CHUNK) > MAX_CHUNKS:
        raise ValueError(f"{op}: last dim {x.shape[-1]} is above {CHUNK * MAX_CHUNKS} columns; use torch.argmax")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _argmax_op(x)
