"""A draft decode step's attention over a bf16 and an fp8 (e4m3) KV cache, per launch configuration.

The draft's shape (Llama-3.2-1B: 8 KV heads, 32 query heads, head dim 64), batch 16, 32K context, one to Γ+1
query tokens, one launch per layer over 16 distinct layer caches (so nothing is served from L2), all 16 in one CUDA
graph. Reports microseconds per launch and the cache bytes read per second, for each (block_n, num_warps,
num_stages, num_splits) and for the launcher's default, with each output's distance from the default's. Launches
use PDL where supported, as the decoder's do. Needs CUDA.

    python benchmarks/dev/bench_kv_dtype.py --out benchmarks/results/fp8_kv/kv_dtype_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import RESULTS, environment, graph_ms, save_json  # noqa: E402

from trtllm_dustin.plugins.kv_dtype import FP8_KV_DTYPE, to_cache_dtype  # noqa: E402
from trtllm_dustin.plugins.verify_attention import verify_attention_forward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", default="1,2", help="query tokens per sequence (comma-separated)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_kv" / "kv_dtype_h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_dtype.py needs a CUDA device")
    dev, heads_kv, group, head_dim = torch.device("cuda"), 8, 4, 64
    B, L, n_layers = args.batch, args.context, args.layers
    s_max = L + 16
    seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
    rows = []
    for name, dtype in (("bfloat16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
        caches = []
        for _ in range(n_layers):
            k = to_cache_dtype(torch.randn(B, heads_kv, s_max, head_dim, device=dev, dtype=torch.bfloat16), dtype)
            v = to_cache_dtype(torch.randn(B, heads_kv, s_max, head_dim, device=dev, dtype=torch.bfloat16), dtype)
            caches.append((k, v))
        for t in (int(x) for x in args.tokens.split(",")):
            q = torch.randn(B, t, heads_kv * group, head_dim, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            lse = torch.empty(B, t, heads_kv * group, device=dev, dtype=torch.float32)
            cache_bytes = 2 * B * heads_kv * (L + t) * head_dim * caches[0][0].element_size()
            tiles = (256, 512) if dtype == FP8_KV_DTYPE else (128, 256)
            configs = [None] + list(itertools.product(tiles, (4, 8), (2, 3, 4), (1, 2, 3)))
            for config in configs:
                extra = {} if config is None else dict(block_n=config[0], num_warps=config[1], num_stages=config[2],
                                                       num_splits=config[3])
                calls = [partial(verify_attention_forward, q, k, v, seqlens, 1 / math.sqrt(head_dim), out, lse,
                                 max_seqlen=L + t, pdl=True, **extra) for k, v in caches]
                try:
                    us = graph_ms(calls, args.replays) * 1e3
                except Exception as error:  # a config that does not compile (shared memory) is reported, not fatal
                    rows.append({"cache": name, "tokens": t, "config": extra or "default", "error": str(error)[:200]})
                    continue
                if config is None:  # the last layer's output, to which every other config is compared
                    baseline = out.float().clone()
                err = float((out.float() - baseline).norm() / baseline.norm())
                row = {"cache": name, "tokens": t, "config": extra or "default", "us_per_launch": us,
                       "cache_bytes": cache_bytes, "tb_per_s": cache_bytes / us / 1e6,
                       "rel_diff_vs_default": err}
                rows.append(row)
                print(row, flush=True)
        del caches
        torch.cuda.empty_cache()
    save_json(args.out, {**environment(), "shape": {"batch": B, "context": L, "layers": n_layers, "kv_heads": heads_kv,
                                                    "group": group, "head_dim": head_dim}, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
