"""The skinny-M kernel on int8 weights (the drafters' projections in weight-only int8) against the same projection in
bf16, and the int8 tactic table that the sweep's winners make.

    python benchmarks/dev/bench_int8_linear.py [--batches 8,16] [--gamma 7] [--ring-target llama-3.1-8b]
        [--head-rows 32768] [--draft llama-3.2-1b] [--draft-gamma 3] [--out benchmarks/results/linear_int8.json]
        [--table-out plugins/tactics/skinny_linear_int8_h200.json]

The shapes are every int8 call of a round at each batch B:
  - the ring drafter's own layers (one layer of the target's width: qkv, o, gate_up, down) at a slot step's B rows
    and an observe pass's B * (Γ + 1), and its subset head (--head-rows x hidden) at B rows;
  - the AR draft's layers (--draft, `--draft-weights int8`) at its step 0's 2B rows and later steps' B rows
    (its output head stays in the model's dtype).
Of the calls that share a table key (row bucket, n, k) the one of most rows is timed. Each candidate of the grid is
compiled first in parallel worker processes (Triton's disk cache), checked against the float64 product with the
dequantized weight, and timed as build_engines/tune.py times the bf16 ones (a CUDA graph of calls cycling over weight
copies that exceed twice the L2, median per call over its replays, plain launches). Beside it, the same projection in
bf16: cuBLAS, and the kernel with the packaged bf16 table's configuration where it has one. Split-K only for the down
projections, the calls that have the decoder's workspace (8 slices of 64 rows: split_k * rows <= 512).

With --table-out the fastest configuration of each shape is written as an int8 tactic table (plugins/linear_tactics.py,
weights "int8"), which KernelConfig(int8_linear_tactics=...) reads; the packaged one is what this sweep wrote.
GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from triton.errors import TritonError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import RESULTS, copy_bandwidth, environment, save_json  # noqa: E402

from trtllm_dustin.build_engines.tune import REPLAYS, graph_ms  # noqa: E402
from trtllm_dustin.models.presets import get_preset  # noqa: E402
from trtllm_dustin.models.quantize import quantize_rows  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.linear_tactics import (  # noqa: E402
    LINEAR_TACTICS_SCHEMA_VERSION,
    LinearConfig,
    row_block,
)
from trtllm_dustin.plugins.skinny_linear import (  # noqa: E402
    MAX_ROWS,
    QUANTIZED_CONFIG,
    SplitKWorkspace,
    skinny_linear_forward,
)

SMS = 132  # the H200's and the H100 SXM's
WORKSPACE_ROWS = 8 * MAX_ROWS  # SplitKWorkspace.for_outputs: 8 slices of MAX_ROWS rows (split_k * rows at most)
_MAX_ERROR = 2e-2  # max |kernel - float64| / max |float64| of a configuration that is timed


@dataclass(frozen=True)
class Int8Shape:
    role: str  # e.g. "ring.gate_up"
    rows: int  # the call's M (the largest of its key's calls)
    n: int
    k: int
    workspace: bool = False  # the caller passes the decoder's SplitKWorkspace (down projections)

    @property
    def key(self) -> tuple[int, int, int]:
        return row_block(self.rows), self.n, self.k


def layer_shapes(prefix: str, preset: str, rows: list[int]) -> list[Int8Shape]:
    config = get_preset(preset)
    hidden, qkv = config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    out = []
    for m in rows:
        out += [Int8Shape(f"{prefix}.qkv", m, qkv, hidden), Int8Shape(f"{prefix}.o", m, hidden,
                                                                       config.num_heads * config.head_dim),
                Int8Shape(f"{prefix}.gate_up", m, 2 * config.intermediate_size, hidden),
                Int8Shape(f"{prefix}.down", m, hidden, config.intermediate_size, workspace=True)]
    return out


def round_shapes(batches: list[int], gamma: int, ring_target: str, head_rows: int, draft: str | None,
                 draft_gamma: int) -> list[Int8Shape]:
    """One shape per table key (the call of most rows), sorted by key."""
    calls = []
    for b in batches:
        calls += layer_shapes("ring", ring_target, [b, b * (gamma + 1)])
        calls.append(Int8Shape("ring.head", b, head_rows, get_preset(ring_target).hidden_size))
        if draft:
            calls += layer_shapes("draft", draft, [2 * b, b] if draft_gamma > 1 else [2 * b])
    by_key: dict[tuple[int, int, int], Int8Shape] = {}
    for call in calls:
        if call.rows > 2 * MAX_ROWS:
            raise SystemExit(f"{call.role} at {call.rows} rows: the int8 kernel takes at most {2 * MAX_ROWS}; lower "
                             "--batches or --gamma")
        kept = by_key.get(call.key)
        if kept is None or call.rows > kept.rows:
            by_key[call.key] = call
    return [by_key[key] for key in sorted(by_key)]


def candidates(shape: Int8Shape) -> list[LinearConfig]:
    """Tiles of 32-256 output columns and 64-512 K per step (512 only at 16 rows), both orientations, three warp /
    stage choices; split-K slices of 2 and 4 for calls with the workspace. Tiles whose pipelined x (2 bytes) and W
    (1 byte) stages exceed 200 KB of shared memory are left out."""
    block_m = row_block(shape.rows)
    out = []
    block_ks = (64, 128, 256, 512) if block_m == 16 else (64, 128, 256)
    for bn, bk, swap, (warps, stages) in itertools.product((32, 64, 128, 256), block_ks, (True, False),
                                                           ((4, 4), (4, 3), (8, 4))):
        if bk > shape.k or (2 * block_m + bn) * bk * stages > 200 * 1024:
            continue
        out.append(LinearConfig(block_n=bn, block_k=bk, split_k=1, swap=swap, num_warps=warps, num_stages=stages))
    if shape.workspace:
        for bn, bk, swap, split in itertools.product((32, 64), (128, 256), (True, False), (2, 4)):
            tiles = -(-shape.n // bn)
            if split * shape.rows <= WORKSPACE_ROWS and shape.k // (split * bk) >= 2 and tiles * split <= SMS * 16:
                out.append(LinearConfig(block_n=bn, block_k=bk, split_k=split, swap=swap, num_warps=4, num_stages=4))
    return list(dict.fromkeys([QUANTIZED_CONFIG, *out]))


def _variant(shape: Int8Shape, config: LinearConfig) -> tuple:
    """What Triton compiles an int8 launch for (see build_engines/tune.py's _variant); split_k's value is runtime."""
    return (row_block(shape.rows), shape.k % config.block_k == 0, config.block_n, config.block_k, config.split_k > 1,
            config.swap, config.num_warps, config.num_stages, *(v % 16 == 0 for v in (shape.rows, shape.n, shape.k)))


def _compile(job: tuple[Int8Shape, LinearConfig]) -> str | None:
    """Worker: one int8 launch of the configuration on the shape (fills Triton's disk cache); why it failed."""
    shape, config = job
    device = torch.device("cuda", 0)
    x = torch.randn(shape.rows, shape.k, dtype=torch.bfloat16, device=device)
    q = torch.randint(-127, 128, (shape.n, shape.k), dtype=torch.int8, device=device)
    scale = torch.ones(shape.n, device=device)
    workspace = SplitKWorkspace.allocate(shape.rows, shape.n, config, device) if config.split_k > 1 else None
    try:
        skinny_linear_forward(x, q, None, config, workspace, scale=scale)
    except (TritonError, ValueError) as error:
        return f"{shape.role} {config}: {type(error).__name__}: {str(error)[:100]}"
    torch.cuda.synchronize()
    return None


def precompile(jobs: list[tuple[Int8Shape, list[LinearConfig]]], workers: int) -> None:
    variants = {}
    for shape, configs in jobs:
        for config in configs:
            variants.setdefault(_variant(shape, config), (shape, config))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(tqdm(pool.map(_compile, variants.values()), total=len(variants), desc="compiling int8 variants"))


def bench(shape: Int8Shape, configs: list[LinearConfig], device: torch.device) -> dict:
    rows, n, k = shape.rows, shape.n, shape.k
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
    row = {"name": shape.role, "M": rows, "N": n, "K": k, "bytes_bf16": bytes_bf16, "bytes_int8": bytes_int8}
    row["cublas_bf16_us"] = graph_ms([partial(F.linear, x, bf16[i]) for i in order], REPLAYS) * 1e3
    tactic = KernelConfig().tactics.lookup(rows, n, k) if rows <= MAX_ROWS else None
    if tactic is not None and tactic.config is not None:
        cfg = tactic.config
        ws = SplitKWorkspace.allocate(rows, n, cfg, device) if cfg.split_k > 1 else None
        row["kernel_bf16_us"] = graph_ms([partial(skinny_linear_forward, x, bf16[i], None, cfg, ws, out=y)
                                          for i in order], REPLAYS) * 1e3
        row["kernel_bf16_config"] = asdict(cfg)
    timed, failed = {}, []
    for cfg in configs:
        ws = SplitKWorkspace.allocate(rows, n, cfg, device) if cfg.split_k > 1 else None
        try:
            got = skinny_linear_forward(x, int8[0][0], None, cfg, ws, out=y, scale=int8[0][1])
        except (TritonError, ValueError) as error:  # out of shared memory and the like: recorded, left out
            failed.append({**asdict(cfg), "error": f"{type(error).__name__}: {str(error)[:100]}"})
            continue
        error = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        if not error < _MAX_ERROR:
            failed.append({**asdict(cfg), "error": f"max error {error:.3g}"})
            continue
        timed[cfg] = graph_ms([partial(skinny_linear_forward, x, int8[i][0], None, cfg, ws, out=y, scale=int8[i][1])
                               for i in order], REPLAYS) * 1e3
    del bf16, int8
    torch.cuda.empty_cache()
    ranked = [{**asdict(cfg), "us": us, "copy_fraction": share(bytes_int8, us)}
              for cfg, us in sorted(timed.items(), key=lambda item: item[1])]
    row.update(cublas_bf16_copy_fraction=share(bytes_bf16, row["cublas_bf16_us"]),
               int8_default_us=timed.get(QUANTIZED_CONFIG), int8_best=ranked[0] if ranked else None,
               int8_configs=ranked[:8], timed=len(ranked), failed=failed[:8])
    best = row["int8_best"] or {"us": float("nan"), "copy_fraction": None}
    nan = float("nan")
    print(f"{shape.role:13s} M={rows:3d} N={n:6d} K={k:6d}  cuBLAS bf16 {row['cublas_bf16_us']:7.1f} us  kernel "
          f"bf16 {row.get('kernel_bf16_us', nan):7.1f} us  int8 default {row['int8_default_us'] or nan:7.1f} us  "
          f"int8 best {best['us']:7.1f} us ({len(ranked)} timed)", flush=True)
    return row


def table(rows: list[dict], gpu: str, command: str) -> dict:
    """The int8 tactic table of the sweep's rows (LinearTactics.from_dict's format, weights "int8")."""
    entries = []
    for row in rows:
        best = row["int8_best"]
        if best is None:
            continue  # no configuration ran: the call takes the fallback (plugins/skinny_linear.py)
        config = {name: best[name] for name in ("block_n", "block_k", "split_k", "swap", "num_warps", "num_stages")}
        entries.append({"rows": row_block(row["M"]), "n": row["N"], "k": row["K"], "config": config, "tie": False,
                        "role": row["name"], "measured_rows": row["M"], "cublas_us": round(row["cublas_bf16_us"], 2),
                        "kernel_us": round(best["us"], 2)})
    return {"schema_version": LINEAR_TACTICS_SCHEMA_VERSION, "weights": "int8",
            "kernel": "trtllm_dustin.plugins.skinny_linear (plugins/skinny_linear.py), int8 weights with fp32 row "
                      "scales", "gpu": gpu, "how": f"{command} (benchmarks/dev/bench_int8_linear.py)",
            "key": "rows = the call's M rounded up to a power of two >= 16 (the kernel's BLOCK_M), n = output "
                   "columns, k = input columns",
            "selection_rule": "config: the fastest int8 configuration of the sweep (an int8 weight has no cuBLAS path "
                              "without widening it first); cublas_us is the same projection's bf16 F.linear, for "
                              "comparison",
            "fallback_rule": "an int8 call whose shape is not listed takes the bf16 table's configuration without its "
                             "split, else QUANTIZED_CONFIG",
            "entries": entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,16", help="sequences per round, comma-separated (default: 8,16)")
    parser.add_argument("--gamma", type=int, default=7, help="the ring drafter's Γ (observe rows B * (Γ + 1); "
                        "default: 7)")
    parser.add_argument("--ring-target", default="llama-3.1-8b", help="preset whose layer width the ring drafter's "
                        "own layers have (default: llama-3.1-8b)")
    parser.add_argument("--head-rows", type=int, default=32768, help="subset head ids (default: 32768)")
    parser.add_argument("--draft", default="llama-3.2-1b", help="the AR draft's preset, or '' for none "
                        "(default: llama-3.2-1b)")
    parser.add_argument("--draft-gamma", type=int, default=3, help="the AR draft's Γ (default: 3)")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1),
                        help="compile processes (default: up to 14)")
    parser.add_argument("--out", type=Path, default=RESULTS / "linear_int8.json")
    parser.add_argument("--table-out", type=Path, default=None, help="write the int8 tactic table here (default: none)")
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches {args.batches!r}: comma-separated ints, say 8,16") from None
    if any(b < 1 for b in batches) or args.gamma < 1 or args.draft_gamma < 1 or args.head_rows < 1:
        raise SystemExit("--batches, --gamma, --draft-gamma and --head-rows must be >= 1")
    for preset in filter(None, (args.ring_target, args.draft)):
        get_preset(preset)  # an unknown name fails here, before any GPU work
    shapes = round_shapes(batches, args.gamma, args.ring_target, args.head_rows, args.draft or None,
                          args.draft_gamma)
    if not torch.cuda.is_available():
        raise SystemExit("bench_int8_linear.py times CUDA graphs: run it on the GPU machine")
    device = torch.device("cuda")
    jobs = [(shape, candidates(shape)) for shape in shapes]
    precompile(jobs, args.workers)
    out = [bench(shape, configs, device) for shape, configs in jobs]
    env = {**environment(), "gpu": torch.cuda.get_device_name(device)}
    save_json(args.out, {**env, "batches": batches, "gamma": args.gamma, "rows": out})
    if args.table_out is not None:
        save_json(args.table_out, table(out, env["gpu"], env["command"]))


if __name__ == "__main__":
    main()
