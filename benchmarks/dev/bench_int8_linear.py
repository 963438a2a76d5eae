"""The skinny-M kernel on int8 weights (a drafter's projections in weight-only int8) against the same projection in
bf16: cuBLAS, and the kernel with the packaged tactic table's configuration where it has one.

    python benchmarks/dev/bench_int8_linear.py [--hidden 4096 --intermediate 14336 --kv 1024 --head-rows 32768]
        [--rows 16,128] [--out benchmarks/results/linear_int8_h200.json]

The shapes are one layer of Llama-3.1-8B's width (the ring drafter's own layers: qkv, o, gate_up, down) and the ring
drafter's subset head, at the rows of a slot step (B) and of an observe pass (B * (Γ + 1)). Each int8 configuration
of a small grid is timed as build_engines/tune.py times the bf16 ones (a CUDA graph of calls cycling over weight
copies that exceed the L2 twice, median per call over its replays), after a check against the float64 product with the
dequantized weight. Bandwidth: the bytes each call moves (weight, scales, activations) over the time, against the
device's copy ceiling. The fastest int8 configuration per shape is what a tactic table for int8 weights would hold;
today every int8 call takes the bf16 table's configuration or QUANTIZED_CONFIG (plugins/skinny_linear.py).
GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.errors import TritonError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import RESULTS, copy_bandwidth, environment, save_json  # noqa: E402

from trtllm_dustin.build_engines.tune import REPLAYS, graph_ms  # noqa: E402
from trtllm_dustin.models.quantize import quantize_rows  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.linear_tactics import LinearConfig  # noqa: E402
from trtllm_dustin.plugins.skinny_linear import (  # noqa: E402
    MAX_ROWS,
    QUANTIZED_CONFIG,
    SplitKWorkspace,
    skinny_linear_forward,
)

SMS = 132  # the H200's (and the H100 SXM's)


def shapes(hidden: int, intermediate: int, kv: int, head_rows: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's projections and a subset head."""
    return [("qkv", hidden + 2 * kv, hidden), ("o", hidden, hidden), ("gate_up", 2 * intermediate, hidden),
            ("down", hidden, intermediate), ("head", head_rows, hidden)]


def grid(n: int, k: int) -> list[LinearConfig]:
    """Tiles of 32-128 output columns, 128-256 K per step, splits of K that keep the grid within 16 waves."""
    out = []
    for bn, bk, swap, split in itertools.product((32, 64, 128), (128, 256), (True, False), (1, 2, 4)):
        tiles = -(-n // bn)
        if k // (split * bk) < 2 or tiles * split > SMS * 16 or (split > 1 and tiles * split < SMS):
            continue
        out.append(LinearConfig(block_n=bn, block_k=bk, split_k=split, swap=swap, num_warps=4, num_stages=4))
    return out


def bench(name: str, rows: int, n: int, k: int, device: torch.device) -> dict:
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = min(256, max(2, -(-2 * l2 // (n * k))))  # int8 copies exceeding twice the L2
    gen = torch.Generator(device=device).manual_seed(rows * 7 + n)
    bf16 = [torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    int8 = [quantize_rows(w) for w in bf16]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=torch.bfloat16)
    y = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    order = [i % copies for i in range(max(24, copies))]
    ref = F.linear(x.double(), int8[0][0].double() * int8[0][1].double()[:, None])
    bandwidth = copy_bandwidth()

    def share(nbytes: int, us: float) -> float | None:
        return nbytes / bandwidth / us * 1e6 if bandwidth else None

    bytes_bf16 = n * k * 2 + (rows * k + rows * n) * 2
    bytes_int8 = n * k + n * 4 + (rows * k + rows * n) * 2
    row = {"name": name, "M": rows, "N": n, "K": k, "bytes_bf16": bytes_bf16, "bytes_int8": bytes_int8}
    row["cublas_bf16_us"] = graph_ms([partial(F.linear, x, bf16[i]) for i in order], REPLAYS) * 1e3
    tactic = KernelConfig().tactics.lookup(rows, n, k) if rows <= MAX_ROWS else None
    workspace = SplitKWorkspace.allocate(rows, n, LinearConfig(block_n=16, split_k=4), device)  # any split <= 4
    if tactic is not None and tactic.config is not None:
        cfg = tactic.config
        ws = workspace if cfg.split_k > 1 and workspace.fits(rows, n, cfg) else SplitKWorkspace.allocate(
            rows, n, cfg, device) if cfg.split_k > 1 else None
        row["kernel_bf16_us"] = graph_ms([partial(skinny_linear_forward, x, bf16[i], None, cfg, ws, out=y)
                                          for i in order], REPLAYS) * 1e3
        row["kernel_bf16_config"] = asdict(cfg)
    timed, failed = {}, []
    for cfg in dict.fromkeys([QUANTIZED_CONFIG, *grid(n, k)]):
        ws = workspace if cfg.split_k > 1 else None
        try:
            got = skinny_linear_forward(x, int8[0][0], None, cfg, ws, out=y, scale=int8[0][1])
        except (TritonError, ValueError) as error:  # out of shared memory and the like: recorded, left out
            failed.append({**asdict(cfg), "error": f"{type(error).__name__}: {str(error)[:100]}"})
            continue
        error = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        if not error < 2e-2:
            failed.append({**asdict(cfg), "error": f"max error {error:.3g}"})
            continue
        timed[cfg] = graph_ms([partial(skinny_linear_forward, x, int8[i][0], None, cfg, ws, out=y, scale=int8[i][1])
                               for i in order], REPLAYS) * 1e3
    ranked = [{**asdict(cfg), "us": us, "copy_fraction": share(bytes_int8, us)}
              for cfg, us in sorted(timed.items(), key=lambda item: item[1])]
    row.update(cublas_bf16_copy_fraction=share(bytes_bf16, row["cublas_bf16_us"]),
               int8_default_us=timed.get(QUANTIZED_CONFIG), int8_best=ranked[0] if ranked else None,
               int8_configs=ranked[:8], failed=failed[:8])
    best = row["int8_best"] or {"us": float("nan"), "copy_fraction": None}
    nan = float("nan")
    print(f"{name:8s} M={rows:3d} N={n:6d} K={k:6d}  cuBLAS bf16 {row['cublas_bf16_us']:7.1f} us  kernel bf16 "
          f"{row.get('kernel_bf16_us', nan):7.1f} us  int8 default {row['int8_default_us'] or nan:7.1f} us  "
          f"int8 best {best['us']:7.1f} us ({best['copy_fraction'] or nan:.0%} of the copy ceiling)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="default: 4096 (Llama-3.1-8B)")
    parser.add_argument("--intermediate", type=int, default=14336, help="default: 14336")
    parser.add_argument("--kv", type=int, default=1024, help="KV heads x head dim (default: 1024)")
    parser.add_argument("--head-rows", type=int, default=32768, help="subset head ids (default: 32768)")
    parser.add_argument("--rows", default="16,128", help="rows per call, at most 128 (default: 16,128: a slot step "
                        "and an observe pass at B = 16, Γ = 7)")
    parser.add_argument("--out", type=Path, default=RESULTS / "linear_int8_h200.json")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if any(not 0 < r <= 2 * MAX_ROWS for r in rows):
        raise SystemExit(f"--rows {args.rows}: each must be in [1, {2 * MAX_ROWS}] (the kernel's row limit)")
    if not torch.cuda.is_available():
        raise SystemExit("bench_int8_linear.py times CUDA graphs: run it on the GPU machine")
    device = torch.device("cuda")
    out = [bench(name, r, n, k, device) for r in rows
           for name, n, k in shapes(args.hidden, args.intermediate, args.kv, args.head_rows)]
    save_json(args.out, {**environment(), "gpu": torch.cuda.get_device_name(device), "rows": out})


if __name__ == "__main__":
    main()
