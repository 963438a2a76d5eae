"""Prefill (time to first token) of the runtime against its bound, at the paper's model shapes (random weights).

    python benchmarks/bench_prefill.py [--models llama-3.1-8b,qwen2.5-7b] [--contexts 8192,32768,65536]
                                       [--batches 1,4,16] [--chunk 8192] [--out benchmarks/results/prefill/...]

What is timed: `runtime.prefill.prefill` (the path every caller takes: the decoder's prefill, the in-flight batcher's
admission) over B random prompts of N tokens into a static cache, the triton attention backend, the fused
elementwise kernels, bf16; CUDA events around the call, median of --reps after one warm-up call per model.

The bound, printed beside each time: attention + GEMMs, each at its own measured ceiling, in this process:
  attention  causal flash SDPA over the whole prompt in one call (no cache, K/V expanded to the query heads),
             one layer at [B, H_q, N, D], times the layer count;
  GEMMs      the prefill's matmul FLOPs (2 * tokens * block parameters per layer, the output head on B rows)
             over the best rate of a large bf16 GEMM measured here (32768 x 4096 x 14336 and two others).
Everything else (norms, rotary, cache writes, the embedding) is counted against us. A (model, context, batch) whose
cache does not fit on the GPU is listed as not fitting (the memory plan), not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, save_json, time_cuda  # noqa: E402

from trtllm_dustin.attention import get_backend  # noqa: E402
from trtllm_dustin.kv_cache import KVCache  # noqa: E402
from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.models.presets import get_preset  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.runtime.prefill import prefill  # noqa: E402

GEMM_PROBES = [(32768, 4096, 14336), (16384, 8192, 8192), (32768, 4096, 4096)]  # (M, K, N)


def gemm_peak_tflops(device: torch.device) -> float:
    """The best bf16 matmul rate of a few large shapes (TFLOP/s): the GEMM half of the bound."""
    best = 0.0
    for m, k, n in GEMM_PROBES:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        ms = statistics.median(time_cuda(lambda a=a, b=b: F.linear(a, b), iters=10, warmup=3))
        best = max(best, 2 * m * k * n / ms / 1e9)
    return best


def sdpa_layer_ms(config, batch: int, n: int, device: torch.device) -> float:
    """Causal flash SDPA over one layer's whole prompt (no cache): the attention half of the bound."""
    q = torch.randn(batch, config.num_heads, n, config.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, config.num_heads, n, config.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return statistics.median(time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=3,
                                       warmup=1))


def gemm_flops(config, batch: int, n: int) -> float:
    """Matmul FLOPs of a prefill of B x N tokens: every block's projections on every token, the head on B rows."""
    return 2.0 * batch * n * config.num_layers * config.layer_parameters() + \
        2.0 * batch * config.hidden_size * config.output_rows()


def fits(config, batch: int, n: int, chunk: int, device: torch.device) -> bool:
    """The memory plan: weights are resident; the cache, one chunk's activations (the FFN's gate/up output, its
    product and a few hidden-sized tensors, bf16) and the SDPA probe must fit, with 4 GiB to spare."""
    kv = config.kv_bytes_per_token(2) * batch * (n + 16)
    rows = batch * min(chunk, n)
    activations = rows * (3 * config.intermediate_size + 6 * config.hidden_size) * 2
    probe = 3 * batch * config.num_heads * n * config.head_dim * 2
    free, _ = torch.cuda.mem_get_info(device)
    return kv + max(activations, probe) + (4 << 30) < free


def bench_point(model, backend, n: int, batch: int, chunk: int, reps: int, peak: float, gen: torch.Generator
                ) -> dict:
    """One (context, batch): the runtime's prefill against the bound, or why it was not run."""
    config, device = model.config, model.embed.weight.device
    point = {"model": config.name, "context": n, "batch": batch, "chunk": chunk}
    if not fits(config, batch, n, chunk, device):
        print(f"{config.name} N={n} B={batch}: the cache ({config.kv_bytes_per_token(2) * batch * n / 2**30:.0f} GiB) "
              "and one chunk's activations do not fit beside the weights")
        return {**point, "fits": False}
    attn = sdpa_layer_ms(config, batch, n, device) * config.num_layers
    gemm = gemm_flops(config, batch, n) / peak / 1e9
    cache = KVCache.allocate(config, batch, n + 16, torch.bfloat16, device)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for _ in range(batch)]
    times = time_cuda(lambda: prefill(model, cache, backend, prompts, chunk), iters=reps, warmup=0)
    ms, bound = statistics.median(times), attn + gemm
    print(f"{config.name} N={n} B={batch}: prefill {ms:.1f} ms, bound {bound:.1f} ms (attention {attn:.1f} + "
          f"GEMMs {gemm:.1f}), {ms / bound:.2f}x the bound, {batch * n / ms * 1e3:.0f} tokens/s")
    return {**point, "fits": True, "prefill_ms": ms, "times_ms": times, "bound_ms": bound, "attention_bound_ms": attn,
            "gemm_bound_ms": gemm, "ratio_to_bound": ms / bound, "tokens_per_s": batch * n / ms * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b", help="presets (random weights)")
    parser.add_argument("--contexts", default="8192,32768,65536", help="prompt tokens per sequence")
    parser.add_argument("--batches", default="1,4,16", help="sequences prefilled together")
    parser.add_argument("--chunk", type=int, default=8192, help="prompt tokens per sequence per forward")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per point (median)")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill" / "prefill_h200.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    peak = gemm_peak_tflops(device)
    print(f"GEMM ceiling (best of {len(GEMM_PROBES)} large bf16 matmuls): {peak:.0f} TFLOP/s")
    rows = []
    for name in args.models.split(","):
        config = get_preset(name)
        model = load_model(f"preset:{name}", device=device, dtype=torch.bfloat16,
                           max_positions=max(contexts) + 16).model
        model.kernels = KernelConfig.from_env()
        backend = get_backend("triton", model.kernels)
        gen = torch.Generator().manual_seed(0)
        warm = KVCache.allocate(config, 1, 4096 + 16, torch.bfloat16, device)
        prefill(model, warm, backend, [torch.randint(0, config.vocab_size, (4096,), generator=gen).tolist()],
                args.chunk)  # compile every kernel once
        del warm
        for n in contexts:
            for batch in batches:
                torch.cuda.empty_cache()
                rows.append(bench_point(model, backend, n, batch, args.chunk, args.reps, peak, gen))
        model = backend = None  # free the weights before the next model loads
    save_json(args.out, {**environment(), "gemm_ceiling_tflops": peak, "kernels": str(KernelConfig.from_env()),
                         "rows": rows})


if __name__ == "__main__":
    main()
