"""Memory-bandwidth ceilings of the GPU: a device-to-device copy (bytes read + written) and a read-only stream.

The decode kernels (attention, skinny GEMMs) only read in their main loops, so the read-only rate, not the copy
rate, is what they can reach. The read kernel streams a buffer several hundred times the L2 in 16-byte loads and
keeps one fp32 sum per program, so nothing but the reads costs time. Every timing is the median of CUDA-event
timed calls over buffers rotated so that no call finds its data in L2.

    python3 benchmarks/bench_bandwidth.py --gib 4 --out benchmarks/results/bandwidth_h200.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import RESULTS, environment, save_json, time_cuda


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Program p sums elements [p * BLOCK * STEPS, (p + 1) * BLOCK * STEPS) of an int32 view."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(STEPS):
        offs = start + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n_elements, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_ms(buffers: list[torch.Tensor], block: int, steps: int, warps: int) -> float:
    n = buffers[0].numel()
    grid = triton.cdiv(n, block * steps)
    out = torch.empty(grid, dtype=torch.int32, device=buffers[0].device)
    calls = iter(range(10**9))

    def one() -> None:
        x = buffers[next(calls) % len(buffers)]
        _read_kernel[(grid,)](x, out, n, BLOCK=block, STEPS=steps, num_warps=warps)

    return statistics.median(time_cuda(one, iters=30, warmup=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="size of each buffer (two are rotated)")
    parser.add_argument("--out", default=str(RESULTS / "bandwidth_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bandwidth needs a CUDA device")
    n = int(args.gib * 2**30) // 4
    buffers = [torch.randint(-100, 100, (n,), dtype=torch.int32, device="cuda") for _ in range(2)]
    nbytes = n * 4
    dst = torch.empty_like(buffers[0])
    calls = iter(range(10**9))
    copy = statistics.median(time_cuda(lambda: dst.copy_(buffers[next(calls) % 2]), iters=30, warmup=3))
    rows = [{"kind": "copy (torch copy_)", "ms": copy, "bytes": 2 * nbytes, "tb_per_s": 2 * nbytes / copy / 1e9}]
    for block, steps, warps in [(1024, 16, 4), (2048, 16, 8), (4096, 8, 8), (4096, 32, 8), (8192, 16, 16)]:
        ms = read_ms(buffers, block, steps, warps)
        rows.append({"kind": f"read (BLOCK={block}, STEPS={steps}, warps={warps})", "ms": ms, "bytes": nbytes,
                     "tb_per_s": nbytes / ms / 1e9})
    for row in rows:
        print(f"{row['kind']:42s} {row['ms']:8.3f} ms  {row['tb_per_s']:.3f} TB/s")
    best_read = max(r["tb_per_s"] for r in rows[1:])
    save_json(Path(args.out), {**environment(), "buffer_bytes": nbytes, "rows": rows,
               "read_tb_per_s": best_read, "copy_tb_per_s": rows[0]["tb_per_s"]})


if __name__ == "__main__":
    main()
