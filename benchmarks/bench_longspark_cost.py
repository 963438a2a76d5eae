"""The fixed-cost drafters' per-round drafting cost and state against the context length, beside the autoregressive
draft's.

Random weights at the real shapes: a Llama-3.1-8B target; a LongSpark drafter sized like the paper's (five blocks of
the target's shape on layers spread over its depth, W = 256 window rows, R = 16 summary entries, a block of 7
slots); the ring drafter (--ring-layers own layers of the target's shape, reading the same five layers' hidden
states, a ring of W = 256 rows; `--methods` picks); and, for contrast, Classic SD's Llama-3.2-1B draft reading its
whole cache. One batch for every context (sized so the target's cache fits at the longest), contexts swept by
setting the committed lengths over one cache. Per context:
- the drafting time of a round (the proposal: CUDA-graph replays, device events);
- for the fixed-cost drafters, the update after a verdict (observe: LongSpark folds Γ + 1 rows per slot into its
  summaries, the ring drafter feeds the accepted drafts into its ring);
- the drafter's state in bytes (LongSpark: summaries and boundary states; the ring drafter: the ring and the
  boundary states; the AR draft: its KV cache up to the context, which it reads every step).

    python benchmarks/bench_longspark_cost.py --contexts 8192,32768,65536,131072 --batch 4
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch
from bench_e2e import PAIRS, add_kernel_switches, bench_ring_drafter, kernel_config, longspark_layers, start_at
from common import RESULTS, environment, save_json

import trtllm_dustin.runtime.experimental  # noqa: F401  (the ring method)
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import random_longspark
from trtllm_dustin.runtime.build import attention_backend, build_runtime
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Observation


def timed(fn, iters: int, device: torch.device) -> float:
    """Mean ms of fn() over iters calls (after 3 warm-up calls), device events on CUDA."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="llama-8b")
    parser.add_argument("--contexts", default="8192,32768,65536,131072",
                        help="committed lengths (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="slots, one batch for every context (default: 4)")
    parser.add_argument("--gamma", type=int, default=3, help="tokens proposed per round (default: 3)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement (default: 50)")
    parser.add_argument("--methods", nargs="+", choices=("longspark", "classic", "ring"),
                        default=["longspark", "classic"], help="drafters timed (default: longspark classic)")
    parser.add_argument("--ring-layers", type=int, default=4, help="the ring drafter's own layers (default: 4, the "
                        "probe's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    add_kernel_switches(parser)  # the kernel paths' A/B switches, as bench_e2e.py's
    args = parser.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(","))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pair = PAIRS[args.pair]
    S = max(contexts) + 64
    t0 = time.perf_counter()
    target = load_model(pair.target, device=device, dtype=dtype, max_positions=S + 16).model
    draft = load_model(pair.draft, device=device, dtype=dtype, max_positions=S + 16, seed=1).model
    reads = longspark_layers(target.config.num_layers, pair.dustin.target_layers[0].layer)
    spark = random_longspark(target, seed=2, target_layers=reads)
    ring = bench_ring_drafter(target, reads, args.ring_layers) if "ring" in args.methods else None
    tcache = KVCache.allocate(target.config, args.batch, S, dtype, device)
    dcache = KVCache.allocate(draft.config, args.batch, S, dtype, device)
    for t in (tcache.k, tcache.v, dcache.k, dcache.v):
        t.normal_()
    kernels = kernel_config(args)
    backend = attention_backend(device, kernels)
    sampling = SlotSampling.batch(SamplingParams(), args.batch, device)
    rows = []
    for method in args.methods:
        decoder = build_runtime(method, target, draft=draft, longspark=spark, ring=ring, target_cache=tcache,
                                draft_cache=dcache,
                                kernels=kernels, backend=backend, gamma=args.gamma,
                                use_cuda_graph=device.type == "cuda")
        drafter = decoder.drafter
        for context in contexts:
            tokens = torch.randint(0, target.config.vocab_size, (args.batch,), device=device)
            start_at(decoder, args.batch, context, tokens, 64)
            decoder.capture(True)
            row = {"method": method, "batch": args.batch, "context": context, "gamma": args.gamma,
                   "draft_ms": timed(partial(drafter.propose, decoder.state, sampling), args.iters, device)}
            if method == "ring":  # a full ring, as after a long prompt (the cost does not depend on it)
                C = drafter.ring.positions.shape[1]
                held = context - C + torch.arange(C, device=device)
                drafter.ring.positions[:, held % C] = held
            if method in ("longspark", "ring"):
                seen = Observation(torch.full((args.batch,), args.gamma, dtype=torch.long, device=device),
                                   tokens, torch.ones(args.batch, dtype=torch.bool, device=device),
                                   decoder.state.lengths, None, decoder.verify_queries, decoder.verify_hidden)
                with torch.inference_mode():
                    row["observe_ms"] = timed(partial(drafter.observe, seen), args.iters, device)
                row["state_bytes"] = drafter.state_bytes()
                row["state_what"] = "summaries (fp32 values + log-normalisers) and boundary states" \
                    if method == "longspark" else "the ring (keys, values, positions) and boundary states"
            else:
                row["observe_ms"] = 0.0
                row["state_bytes"] = draft.config.kv_bytes_per_token(2) * args.batch * context
                row["state_what"] = "the draft's KV cache up to the context (read every step)"
            row["drafting_ms"] = row["draft_ms"] + row["observe_ms"]
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    summary = {"goal": "flat within 5 % from the shortest to the longest context"}
    for method in ("longspark", "ring"):
        mine = [r for r in rows if r["method"] == method]
        if mine:
            times = [r["drafting_ms"] for r in mine]
            summary[f"{method}_drafting_ms_max_over_min"] = max(times) / min(times)
            summary[f"{method}_state_bytes_constant"] = len({r["state_bytes"] for r in mine}) == 1
    print(summary)
    where = "h200" if device.type == "cuda" else "cpu"
    out = args.out or RESULTS / "longspark" / f"cost_vs_context_{args.pair}_{where}.json"
    save_json(out, {**environment(), "pair": args.pair, "target": pair.target, "draft": pair.draft,
                    "longspark": {"target_layers": list(spark.config.target_layers), "window": spark.config.window,
                                  "summary": spark.config.summary, "block": spark.config.block,
                                  "weights": "random (real shapes)"},
                    "ring": {"read_layers": list(ring.config.read_layers), "own_layers": list(ring.config.own_layers),
                             "window": ring.config.window, "block": ring.config.block,
                             "weights": "random (real shapes)"} if ring is not None else None,
                    "kernels": kernels.to_json(), "wall_s": time.perf_counter() - t0, "summary": summary,
                    "rows": rows})
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for method, label in (("longspark", "LongSpark (fixed cost)"), ("ring", "ring drafter (fixed cost)"),
                          ("classic", "AR draft, full cache (Classic SD)")):
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        ctx = [r["context"] / 1024 for r in mine]
        a.plot(ctx, [r["drafting_ms"] for r in mine], marker="o", label=label)
        b.plot(ctx, [r["state_bytes"] / 2**20 for r in mine], marker="o", label=label)
    a.set_xlabel("context (K tokens)")
    a.set_ylabel("drafting per round (ms)")
    b.set_xlabel("context (K tokens)")
    b.set_ylabel("drafter state (MiB)")
    b.set_yscale("log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Drafting cost vs context, batch {rows[0]['batch']}, gamma {rows[0]['gamma']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
