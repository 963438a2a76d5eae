"""Skinny-M projections of the e2e shapes: cuBLAS (F.linear) against the Triton skinny_linear kernel.

    python benchmarks/dev/bench_linear.py [--pair llama-8b] [--out benchmarks/results/linear_h200.json]

For each projection of the pair's target (verify: M = B * (Γ + 1) rows) and draft (M = B and 2B rows), every
candidate launch configuration is timed against F.linear in the same process. Timing: a CUDA graph of 24 calls
that cycle over enough weight copies to exceed the L2 twice (in a decode step each layer reads its own weights),
replays timed one by one with CUDA events, median per call. Bandwidth: weight + activation bytes / time against
the 4.26 TB/s device copy ceiling. The candidates are compiled first in parallel worker processes (Triton's disk
cache), so the sweep itself only times. Plain launches (no PDL), as the tactic table's tie rule assumes. The
packaged table (plugins/tactics/skinny_linear_h200.json) holds each shape's fastest configuration where it was at
least 2 % faster than cuBLAS (within 1 %: a tie); its entries name the result files they came from.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import COPY_BANDWIDTH, RESULTS, environment, graph_ms, save_json  # noqa: E402

from trtllm_dustin.models.presets import get_preset  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.linear_tactics import LinearConfig, row_block  # noqa: E402
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace, skinny_linear_forward  # noqa: E402

L2_BYTES = 60 << 20
CALLS_PER_GRAPH = 24
REPLAYS = 12
# pair -> (target, draft, Γ): the pairs of bench_e2e.py
PAIRS = {"llama-8b": ("llama-3.1-8b", "llama-3.2-1b", 3), "qwen-7b": ("qwen2.5-7b", "qwen2.5-0.5b", 3),
         "qwen-14b": ("qwen2.5-14b", "qwen2.5-0.5b", 3)}


def projections(pair: str, batch: int) -> list[dict]:
    """(name, M, N, K, bias) of every projection a round of the pair runs at this batch size (and vanilla's)."""
    target_name, draft_name, gamma = PAIRS[pair]
    shapes = []
    roles = (("target", target_name, (batch * (gamma + 1), batch)), ("draft", draft_name, (batch, 2 * batch)))
    for role, name, rows in roles:
        c = get_preset(name)
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        mats = {"qkv": (qkv, c.hidden_size, c.qkv_bias), "o": (c.hidden_size, c.num_heads * c.head_dim, False),
                "gate_up": (2 * c.intermediate_size, c.hidden_size, False),
                "down": (c.hidden_size, c.intermediate_size, False),
                "lm_head": (c.vocab_size, c.hidden_size, False)}
        for m in rows:
            for mat, (n, k, bias) in mats.items():
                if mat == "lm_head" and role == "draft" and m != batch:
                    continue  # the draft's head runs on one row per sequence (the target's B rows: vanilla)
                shapes.append({"name": f"{role}.{mat}", "M": m, "N": n, "K": k, "bias": bias})
    return shapes


def candidates(m: int, n: int, k: int) -> list[LinearConfig]:
    block_m = row_block(m)
    out = []
    for bn, bk, stages, swap in itertools.product((32, 64, 128, 256), (64, 128, 256), (3, 4, 6), (True, False)):
        if (bn + block_m) * bk * 2 * stages > 200 * 1024 or (not swap and block_m < 64 and bn < 64):
            continue
        tiles = -(-n // bn)
        for split in (1, 2, 3, 4, 6, 8):
            if k // (split * bk) < 2 or tiles * split > 132 * 16 or (split > 1 and tiles * split < 132):
                continue
            out.append(LinearConfig(block_n=bn, block_k=bk, split_k=split, swap=swap,
                                    num_warps=8 if bn * block_m >= 256 * 32 else 4, num_stages=stages))
    return out


def _compile(job: tuple[dict, list[LinearConfig]]) -> list[str]:
    """Worker: run each config once on the shape (fills Triton's disk cache); returns the configs that failed."""
    shape, configs = job
    dev = torch.device("cuda")
    x = torch.randn(shape["M"], shape["K"], dtype=torch.bfloat16, device=dev)
    w = torch.randn(shape["N"], shape["K"], dtype=torch.bfloat16, device=dev)
    b = torch.randn(shape["N"], dtype=torch.bfloat16, device=dev) if shape["bias"] else None
    failed = []
    for cfg in configs:
        try:
            workspace = SplitKWorkspace.allocate(shape["M"], shape["N"], cfg, dev) if cfg.split_k > 1 else None
            skinny_linear_forward(x, w, b, cfg, workspace)
        except Exception as error:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            failed.append(f"{cfg}: {type(error).__name__}: {str(error)[:120]}")
    torch.cuda.synchronize()
    return failed


def bench_shape(shape: dict, configs: list[LinearConfig]) -> dict:
    dev = torch.device("cuda")
    M, N, K = shape["M"], shape["N"], shape["K"]
    wbytes = N * K * 2
    copies = max(2, -(-2 * L2_BYTES // wbytes))
    ws = [torch.randn(N, K, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
    bs = [torch.randn(N, dtype=torch.bfloat16, device=dev) if shape["bias"] else None for _ in range(copies)]
    x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    order = [i % copies for i in range(CALLS_PER_GRAPH)]
    moved = wbytes + (M * K + M * N) * 2
    ref = F.linear(x.float(), ws[0].float(), None if bs[0] is None else bs[0].float())
    base = graph_ms([lambda i=i: F.linear(x, ws[i], bs[i]) for i in order], REPLAYS)
    row = {**shape, "bytes": moved, "cublas_us": base * 1e3,
           "cublas_copy_fraction": moved / COPY_BANDWIDTH / base * 1e3, "configs": []}
    for cfg in configs:
        workspace = SplitKWorkspace.allocate(M, N, cfg, dev) if cfg.split_k > 1 else None
        try:
            got = skinny_linear_forward(x, ws[0], bs[0], cfg, workspace, out=y).float()
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
            row["configs"].append({**asdict(cfg), "error": f"{type(error).__name__}: {str(error)[:100]}"})
            continue
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        if not err < 2e-2:
            row["configs"].append({**asdict(cfg), "error": err})
            continue
        ms = graph_ms([lambda i=i, c=cfg, w=workspace: skinny_linear_forward(x, ws[i], bs[i], c, w, out=y)
                       for i in order], REPLAYS)
        row["configs"].append({**asdict(cfg), "us": ms * 1e3, "copy_fraction": moved / COPY_BANDWIDTH / ms * 1e3})
    timed = sorted((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
    row["best"] = timed[0] if timed else None
    row["configs"] = timed[:8] + [c for c in row["configs"] if "error" in c][:8]
    ws.clear()
    torch.cuda.empty_cache()
    best = row["best"]
    print(f"{shape['name']:15s} M={M:3d} N={N:6d} K={K:6d}  cublas {row['cublas_us']:7.1f} us "
          f"({row['cublas_copy_fraction']:.0%})  best {best['us'] if best else float('nan'):7.1f} us "
          f"({best['copy_fraction'] if best else 0:.0%}) {best}", flush=True)
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
    shapes = [s for s in projections(args.pair, args.batch) if not args.only or s["name"] in args.only.split(",")]
    if args.skip_tuned:
        tactics = KernelConfig.from_env().tactics
        shapes = [s for s in shapes if tactics.lookup(s["M"], s["N"], s["K"]) is None]
    jobs = [(s, candidates(s["M"], s["N"], s["K"])) for s in shapes]
    variants = {}  # one compile per distinct kernel: split_k itself is a runtime argument
    for s, cfgs in jobs:
        for c in cfgs:
            key = (row_block(s["M"]), s["K"] % c.block_k == 0, s["bias"], c.block_n, c.block_k,
                   c.split_k > 1, c.swap, c.num_warps, c.num_stages)
            variants.setdefault(key, (s, c))
    todo = list(variants.values())
    chunks = [(s, [c]) for s, c in todo]
    import multiprocessing

    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        fails = [f for fs in pool.map(_compile, chunks) for f in fs]
    print(f"compiled {len(todo)} kernel variants; {len(fails)} failed", *fails[:5], sep="\n", flush=True)
    rows = [bench_shape(s, cfgs) for s, cfgs in jobs]  # a variant that failed to compile fails again there, recorded
    save_json(args.out, {**environment(), "pair": args.pair, "batch": args.batch, "rows": rows})


if __name__ == "__main__":
    main()
