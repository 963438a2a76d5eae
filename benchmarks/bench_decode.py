"""One-token forward latency of a random-weight preset at a long context, beside its bandwidth floor.

A decode step must read every weight once and every cached K/V byte once; its floor is
(weight bytes + KV bytes) / 4.26 TB/s. The cache is filled with random values and the model's forward of one
token per sequence is replayed from a CUDA graph at a fixed context (the lengths do not advance), so the number
is the steady-state cost of the forward alone; bench_e2e.py times whole rounds (sampling and commit included).

    python benchmarks/bench_decode.py --model preset:llama-3.1-8b --batch-size 16 --context 32768
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, copy_bandwidth, environment, save_json, time_cuda

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.cuda_graph import CapturedStep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:llama-3.1-8b")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--backends", default="triton,reference")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS / "decode_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA device")

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, max_positions=args.context + 64)
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    model, config = loaded.model, loaded.model.config
    t0 = time.perf_counter()
    cache = KVCache.allocate(config, args.batch_size, args.context + 64, torch.bfloat16, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    cache.seqlens.fill_(args.context)
    torch.cuda.synchronize()
    cache_s = time.perf_counter() - t0

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = config.kv_bytes_per_token(2) * args.batch_size * (args.context + 1)
    bandwidth = copy_bandwidth()  # None off the H200: the floor is left out
    floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3 if bandwidth else None
    rows = []
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, 1), device="cuda")
    kernels = KernelConfig.from_env()
    model.kernels = kernels
    meta = AttentionMetadata(cache_seqlens=cache.seqlens)
    for name in args.backends.split(","):
        backend = get_backend(name, kernels)
        step = CapturedStep(functools.partial(model, tokens, cache, meta, backend))
        # seqlens are not advanced between replays: every step runs at the same context.
        times = time_cuda(step, iters=args.iters)
        med = statistics.median(times)
        rows.append({"backend": name, "median_ms": med, "min_ms": min(times),
                     "tokens_per_s": args.batch_size / med * 1e3, "floor_ms": floor_ms,
                     "fraction_of_floor": floor_ms / med if floor_ms else None})
        floor = f"floor {floor_ms:.3f} ms -> {floor_ms / med:.1%} of it" if floor_ms else "no floor for this GPU"
        print(f"{name:10s} step {med:8.3f} ms (min {min(times):.3f})  {floor}, "
              f"{args.batch_size / med * 1e3:.0f} tokens/s")
    save_json(Path(args.out), {
        **environment(), "model": args.model, "batch_size": args.batch_size, "context": args.context,
        "init_weights_s": init_s, "init_cache_s": cache_s, "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
        "rows": rows})


if __name__ == "__main__":
    main()
