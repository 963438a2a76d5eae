"""Prefill attention over one layer: our Triton kernel (launch-parameter grid), torch's flex_attention and causal
flash SDPA without a cache, in one process on the same inputs.

    python benchmarks/dev/bench_prefill_attention.py [--contexts 8192,32768] [--chunks 2048,8192] [--flex]

A prompt of N tokens is attended chunk by chunk as runtime/prefill.py does (each chunk's queries against the
cache up to itself, the chunk at offset L = start); the time of a whole prompt is the sum over its chunks. The
bound is causal flash SDPA over the whole prompt in one call, no cache, K/V already expanded to the query heads
(the attention half of the prefill bound of bench_prefill.py). FLOP count: 2 * 2 * H_q * D * (causal pairs).
Times: CUDA events, median of `--iters` after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import environment, save_json, time_cuda  # noqa: E402

from trtllm_dustin.plugins.prefill_attention import prefill_attention_forward  # noqa: E402

SHAPES = {"llama-8b": (32, 8, 128), "qwen-7b": (28, 4, 128)}  # H_q, H_kv, D
# (block_m, block_n, num_warps, num_stages); runs 1-2 and the variants tried: benchmarks/dev/README.md
GRID = [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 4), (256, 64, 8, 3)]


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def median_ms(fn, iters: int) -> float:
    return statistics.median(time_cuda(fn, iters=iters, warmup=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", default="llama-8b,qwen-7b")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--chunks", default="2048,4096,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--flex", action="store_true", help="also time torch's flex_attention (compiles first)")
    parser.add_argument("--out", type=Path, default=Path("prefill_attention_sweep.json"))
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for n in (int(c) for c in args.contexts.split(",")):
            rows.append(bench_context(shape, n, args))
            torch.cuda.empty_cache()
    save_json(args.out, {**environment(), "rows": rows})


def bench_context(shape: str, n: int, args: argparse.Namespace) -> dict:
    """One layer of one shape at prompt length n: flash SDPA, the Triton grid per chunk size, flex_attention."""
    device, dtype, B = torch.device("cuda"), torch.bfloat16, args.batch
    hq, hkv, d = SHAPES[shape]
    torch.manual_seed(0)
    q = torch.randn(B, n, hq, d, device=device, dtype=dtype)
    k = torch.randn(B, hkv, n, d, device=device, dtype=dtype)
    v = torch.randn(B, hkv, n, d, device=device, dtype=dtype)
    flops = 4 * hq * d * causal_pairs(n) * B
    ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    qt = q.transpose(1, 2).contiguous()
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(qt, ke, ve, is_causal=True), args.iters)
    row = {"shape": shape, "context": n, "batch": B, "sdpa_causal_ms": sdpa, "sdpa_tflops": flops / sdpa / 1e9,
           "triton": []}
    print(f"{shape} N={n} B={B}: flash SDPA {sdpa:.2f} ms ({flops / sdpa / 1e9:.0f} TFLOP/s)")
    out = torch.empty_like(q)

    def run(chunk, bm, bn, warps, stages):
        for s in range(0, n, chunk):
            seq = torch.full((B,), s, dtype=torch.int32, device=device)
            prefill_attention_forward(q[:, s:s + chunk], k, v, seq, None, d ** -0.5, out[:, s:s + chunk],
                                      block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)

    for chunk in (int(c) for c in args.chunks.split(",")):
        if chunk > n:
            continue
        for launch in GRID:
            try:
                ms = median_ms(lambda chunk=chunk, launch=launch: run(chunk, *launch), args.iters)
            except Exception as e:  # a tile that does not fit in shared memory: record and go on
                row["triton"].append({"chunk": chunk, "launch": list(launch), "error": str(e)[:200]})
                continue
            row["triton"].append({"chunk": chunk, "launch": list(launch), "ms": ms, "tflops": flops / ms / 1e9,
                                  "vs_sdpa": ms / sdpa})
            print(f"  chunk {chunk} launch {launch}: {ms:.2f} ms ({ms / sdpa:.2f}x SDPA)")
    best = min((r for r in row["triton"] if "ms" in r), key=lambda r: r["ms"])
    run(n, *best["launch"])
    ref = F.scaled_dot_product_attention(qt, ke, ve, is_causal=True).transpose(1, 2)
    row["best"] = best
    row["max_abs_err_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
    if args.flex:
        row["flex"] = flex_ms(q, k, v, n, args.iters, sdpa)
    return row


def flex_ms(q, k, v, n, iters, sdpa) -> dict:
    """torch's flex_attention (compiled) on the whole prompt with a causal block mask, GQA."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n, device="cuda")
        flex = torch.compile(flex_attention)
        qt, kt, vt = q.transpose(1, 2), k, v
        fn = lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True)  # noqa: E731
        ms = median_ms(fn, iters)
        print(f"  flex_attention: {ms:.2f} ms ({ms / sdpa:.2f}x SDPA)")
        return {"ms": ms, "vs_sdpa": ms / sdpa}
    except Exception as e:  # flex needs a working inductor; record why not
        print(f"  flex_attention failed: {type(e).__name__}: {e}"[:300])
        return {"error": f"{type(e).__name__}: {e}"[:300]}


if __name__ == "__main__":
    main()
