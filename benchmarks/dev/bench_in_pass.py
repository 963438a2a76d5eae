"""What one selection layer of in-pass selection costs (runtime/selectors/in_pass.py), kernel by kernel, at the
paper's shapes: B sequences of L cached tokens, T = Γ + 1 verified queries, every query head scoring.

  verify            full-cache verify attention of one layer (what a dense layer costs): K + V read once
  sparse            sparse verify attention over k positions (what every other layer costs)
  score             srh_score over every head without lse (the in-pass selection layer's pass: K read once, the
                    scores kept and summed)
  verify+lse+score  a dense selection layer: verify attention with lse, then srh_score with that lse (K + V, then K)
  topk              the choice: top-k of [B, S] over the candidates (torch.topk, unsorted)
  pages             the page-bound variant's score: Quest bounds from the pages' key ranges (an eighth of K, fp32)

A fused "attention that also emits the mass" reads K + V for the output and needs the log-sum-exp before any
position's probability, so it reads K twice however it is written: the verify+lse+score row is its byte count. CUDA
graph replays, median of many, every time beside the bytes it moves at the measured copy ceiling.

    python benchmarks/dev/bench_in_pass.py --out benchmarks/results/fidelity2/in_pass_kernels_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, environment, graph_ms, save_json  # noqa: E402

from trtllm_dustin.plugins import sparse_verify_attention, srh_score, verify_attention  # noqa: E402
from trtllm_dustin.runtime.selectors.in_pass import head_weights, page_bounds, page_key_range  # noqa: E402

SHAPES = {"llama-8b": (32, 8, 128), "qwen-72b": (64, 8, 128), "qwen-7b": (28, 4, 128)}  # query heads, KV heads, D


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=4, help="T = Γ + 1 verified queries (default: %(default)s)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--heads", type=int, nargs="*", default=None,
                        help="the query heads that score (default: every head)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_in_pass.py times CUDA kernels; run it on the GPU machine")
    hq, hkv, d = SHAPES[args.shape]
    B, L, T, dev = args.batch, args.context, args.tokens, torch.device("cuda")
    S = L + 64
    torch.manual_seed(0)
    k = torch.randn(B, hkv, S, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, hkv, S, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, T, hq, d, device=dev, dtype=torch.bfloat16)
    lengths = torch.full((B,), L, dtype=torch.int32, device=dev)
    heads = tuple(args.heads) if args.heads else tuple(range(hq))
    out = torch.empty_like(q)
    scores = torch.empty(B, S, device=dev)
    kv_bytes = 2 * B * hkv * (L + T) * d * 2
    k_bytes = kv_bytes // 2
    rows = []

    bandwidth = copy_bandwidth()  # None off the H200: no floor

    def row(name: str, ms: float, bytes_moved: int, **extra) -> None:
        floor = bytes_moved / bandwidth * 1e3 if bandwidth else None
        rows.append({"kernel": name, "ms": ms, "bytes": bytes_moved, "floor_ms": floor, **extra})
        print(f"{name:28s} {ms * 1e3:8.1f} us  floor " + (f"{floor * 1e3:8.1f} us" if floor else "n/a"), flush=True)

    row("verify", graph_ms([lambda: verify_attention(q, k, v, lengths, out=out)], args.replays), kv_bytes)
    groups = len({h // (hq // hkv) for h in heads})  # the KV heads whose keys the scoring reads
    row("score", graph_ms([lambda: srh_score(q, k, lengths, heads, out=scores)], args.replays),
        k_bytes * groups // hkv)

    def dense_selection() -> None:
        _, lse = verify_attention(q, k, v, lengths, out=out, return_lse=True)
        srh_score(q, k, lengths, heads, lse=lse, out=scores)

    row("verify+lse+score", graph_ms([dense_selection], args.replays), kv_bytes + k_bytes * groups // hkv)
    positions = torch.arange(S, device=dev)[None, :]
    candidate = (positions >= 4) & (positions < L - 16)
    for budget in args.budgets:
        idx = torch.randint(0, L, (B, budget), device=dev, dtype=torch.int32)
        row(f"sparse k={budget}", graph_ms([lambda i=idx: sparse_verify_attention(q, k, v, lengths, i, out=out)],
                                           args.replays), 2 * B * hkv * (budget + T) * d * 2, budget=budget)
        free = budget - 20
        row(f"topk k={budget}", graph_ms([lambda f=free: torch.topk(scores.masked_fill(~candidate, float("-inf")),
                                                                     f, dim=1, sorted=False)], args.replays),
            B * S * 4, budget=budget)
    low, high = page_key_range(k, lengths)
    weights = head_weights(heads, hq, dev)
    row("pages", graph_ms([lambda: page_bounds(q, low, high, lengths, weights)], args.replays),
        2 * low.numel() * 4)
    save_json(args.out, {**environment(), "shape": args.shape, "batch": B, "context": L, "tokens": T, "heads": heads,
                         "query_heads": hq, "kv_heads": hkv, "head_dim": d, "rows": rows})


if __name__ == "__main__":
    main()
