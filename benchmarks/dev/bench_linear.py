"""Skinny-M projections of the e2e shapes: cuBLAS (F.linear) against the Triton skinny_linear kernel.

    python benchmarks/dev/bench_linear.py [--pair llama-8b] [--out benchmarks/results/linear_h200.json]

For each projection of the pair's target (verify: M = B * (Γ + 1) rows; vanilla: B) and draft (M = B and 2B rows),
one per tactic-table key (build_engines/tune.py's decode_shapes), every candidate launch configuration of a wider
grid than the engine build's is timed against F.linear in the same process, by the engine build's tactic tuner
(build_engines/tune.py: the candidates compiled first in parallel worker processes; a CUDA graph of calls cycling
over weight copies that exceed the L2 twice, replays timed one by one with CUDA events, median per call; plain
launches, no PDL, as the tactic table's tie rule assumes). Bandwidth: weight + activation bytes / time against the
4.26 TB/s device copy ceiling. The packaged table (plugins/tactics/skinny_linear_h200.json) holds each shape's
fastest configuration where it was at least 2 % faster than cuBLAS (within 1 %: a tie); its entries name the result
files they came from.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import RESULTS, copy_bandwidth, environment, save_json  # noqa: E402

from trtllm_dustin.build_engines.tune import ProjectionShape, decode_shapes, precompile, time_shape  # noqa: E402
from trtllm_dustin.models.presets import get_preset  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.linear_tactics import LinearConfig, row_block  # noqa: E402

SMS = 132  # the H200's
# pair -> (target, draft, Γ): the pairs of bench_e2e.py
PAIRS = {"llama-8b": ("llama-3.1-8b", "llama-3.2-1b", 3), "qwen-7b": ("qwen2.5-7b", "qwen2.5-0.5b", 3),
         "qwen-14b": ("qwen2.5-14b", "qwen2.5-0.5b", 3)}


def projections(pair: str, batch: int) -> list[ProjectionShape]:
    """Every projection a round of the pair runs at this batch size (and vanilla's), one per table key."""
    target, draft, gamma = PAIRS[pair]
    return decode_shapes(get_preset(target), get_preset(draft), batch, gamma)


def candidates(shape: ProjectionShape) -> list[LinearConfig]:
    """The wide grid (the engine build's compact one, tune.linear_candidates, keeps the tiles that won here)."""
    block_m = row_block(shape.rows)
    out = []
    for bn, bk, stages, swap in itertools.product((32, 64, 128, 256), (64, 128, 256), (3, 4, 6), (True, False)):
        if (bn + block_m) * bk * 2 * stages > 200 * 1024 or (not swap and block_m < 64 and bn < 64):
            continue
        tiles = -(-shape.n // bn)
        for split in (1, 2, 3, 4, 6, 8) if shape.workspace else (1,):
            if shape.k // (split * bk) < 2 or tiles * split > SMS * 16 or (split > 1 and tiles * split < SMS):
                continue
            out.append(LinearConfig(block_n=bn, block_k=bk, split_k=split, swap=swap,
                                    num_warps=8 if bn * block_m >= 256 * 32 else 4, num_stages=stages))
    return out


def bench_shape(shape: ProjectionShape, configs: list[LinearConfig]) -> dict:
    M, N, K = shape.rows, shape.n, shape.k
    moved = N * K * 2 + (M * K + M * N) * 2
    timing = time_shape(shape, configs, torch.device("cuda"))
    bandwidth = copy_bandwidth()  # None off the H200: no ceiling to compare with, the fractions are left out

    def fraction(us: float) -> float | None:
        return moved / bandwidth / us * 1e6 if bandwidth else None

    timed = [{**asdict(cfg), "us": us, "copy_fraction": fraction(us)}
             for cfg, us in sorted(timing.kernel_us.items(), key=lambda item: item[1])]
    errors = [{**asdict(cfg), "error": why} for cfg, why in timing.failed.items()]
    row = {"name": shape.role, "M": M, "N": N, "K": K, "bias": shape.bias, "bytes": moved,
           "cublas_us": timing.cublas_us, "cublas_copy_fraction": fraction(timing.cublas_us),
           "configs": timed[:8] + errors[:8], "best": timed[0] if timed else None}
    best = row["best"]

    def share(x: float | None) -> str:
        return f"{x:.0%}" if x is not None else "n/a"

    print(f"{shape.role:15s} M={M:3d} N={N:6d} K={K:6d}  cublas {row['cublas_us']:7.1f} us "
          f"({share(row['cublas_copy_fraction'])})  best {best['us'] if best else float('nan'):7.1f} us "
          f"({share(best['copy_fraction'] if best else None)}) {best}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="llama-8b", choices=sorted(PAIRS))
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (rows: B, 2B, B * (Γ + 1))")
    parser.add_argument("--skip-tuned", action="store_true",
                        help="leave out shapes the tactic table already has an entry for (the packaged one, or "
                        "TRTLLM_DUSTIN_LINEAR_TACTICS)")
    parser.add_argument("--only", default="", help="comma-separated projection names (e.g. target.gate_up)")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=RESULTS / "linear_h200.json")
    args = parser.parse_args()
    shapes = [s for s in projections(args.pair, args.batch) if not args.only or s.role in args.only.split(",")]
    if args.skip_tuned:
        tactics = KernelConfig.from_env().tactics
        shapes = [s for s in shapes if tactics.lookup(s.rows, s.n, s.k) is None]
    jobs = [(s, candidates(s)) for s in shapes]
    fails = precompile(jobs, torch.device("cuda"), workers=args.workers)
    print(f"compiled the kernel variants; {len(fails)} failed", *fails[:5], sep="\n", flush=True)
    rows = [bench_shape(s, cfgs) for s, cfgs in jobs]  # a variant that failed to compile fails again there, recorded
    save_json(args.out, {**environment(), "pair": args.pair, "batch": args.batch, "rows": rows})


if __name__ == "__main__":
    main()
