"""Speculative rounds on the GPU: every method end to end, side by side in one process, with per-phase times.

Two pairs:
  smollm2    the real SmolLM2-135M-Instruct target (GGUF) and a random-weight draft with its vocabulary
             (`preset:smollm2-draft-random`, until a trained draft exists); prompts are slices of Python's
             standard-library sources; real prefill, real acceptance.
  llama-8b   Llama-3.1-8B + Llama-3.2-1B shapes with random weights; the caches are filled with random K/V at
             the given context instead of a prefill (a round costs the same whatever the values), then rounds
             run from there. Random weights accept almost nothing, so tau here is not a quality number.
Each method runs twice: a throughput pass without events, then a profiling pass with CUDA events per phase.
The Dustin configs here are hand-written placeholders (paper-sized: 1 target layer x 4 heads, 3 draft layers x
4 heads), not the output of the search; they set the estimator's cost, not its quality.

    python benchmarks/bench_round.py --pair llama-8b --batch-size 16 --context 32768
"""

from __future__ import annotations

import argparse
import functools
import sysconfig
from pathlib import Path

import torch
from common import COPY_BANDWIDTH, RESULTS, Clock, environment, save_json

from trtllm_dustin.attention import get_backend
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.methods import METHODS, MethodSetup, build_decoder
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.vanilla import GenerationConfig

PAIRS = {
    "smollm2": (None, "preset:smollm2-draft-random",
                DustinConfig(target_layers=(LayerHeads(15, (0, 3, 5, 8)),),
                             draft_layers=(LayerHeads(1, (0, 2)), LayerHeads(2, (1, 3)), LayerHeads(3, (0, 1))),
                             budget=512, m=128)),
    "llama-8b": ("preset:llama-3.1-8b", "preset:llama-3.2-1b",
                 DustinConfig(target_layers=(LayerHeads(16, (0, 8, 16, 24)),),
                              draft_layers=tuple(LayerHeads(i, (0, 8, 16, 24)) for i in (4, 8, 12)), budget=512,
                              m=128)),
}


def source_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` different `length`-token slices of the standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:60])
    ids = tokenizer.encode(text)
    step = max(1, (len(ids) - length) // batch)
    return [ids[i * step: i * step + length] for i in range(batch)]


def run_real(args, target, draft, tokenizer, dustin) -> list[dict]:
    prompts = source_prompts(tokenizer, args.batch_size, args.context)
    S = args.context + args.max_new_tokens + 8
    rows = []
    for method in args.methods:
        setup = MethodSetup(target=target, target_cache=KVCache.allocate(target.config, args.batch_size, S,
                                                                         torch.bfloat16, "cuda"),
                            backend=get_backend("triton"), draft=draft,
                            draft_cache=KVCache.allocate(draft.config, args.batch_size, S, torch.bfloat16, "cuda"),
                            gamma=args.gamma, dustin=dustin)
        decoder = build_decoder(method, setup)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=())  # fixed length per method
        decoder.generate(prompts, config)  # warm-up: JIT and graph capture
        result = decoder.generate(prompts, config)
        profiled = decoder.generate(prompts, config, profile=True)
        rows.append({"method": method, "decode_tokens_per_s": result.decode_tokens_per_s,
                     "decode_ms": result.decode_ms, "prefill_ms": result.prefill_ms, "steps": result.decode_steps,
                     "tau": getattr(result, "tau", 1.0), "committed_hist": getattr(result, "committed_hist", None),
                     "phase_ms_per_round": {k: v / profiled.decode_steps for k, v in
                                            getattr(profiled, "phase_ms", {}).items()}})
        print(rows[-1])
        del decoder, setup
        torch.cuda.empty_cache()
    return rows


def run_shape(args, target, draft, dustin) -> list[dict]:
    timed = Clock(torch.device("cuda"))
    B, L, gamma = args.batch_size, args.context, args.gamma
    S = L + args.rounds * (gamma + 1) * 3 + 64
    tcache = KVCache.allocate(target.config, B, S, torch.bfloat16, "cuda")
    dcache = KVCache.allocate(draft.config, B, S, torch.bfloat16, "cuda")
    for t in (tcache.k, tcache.v, dcache.k, dcache.v):
        t.normal_()
    rows = []
    weights = {m: sum(p.numel() * p.element_size() for p in m.parameters()) for m in (target, draft)}
    kv_step = target.config.kv_bytes_per_token(2) * B * L
    floor_vanilla_ms = (weights[target] + kv_step) / COPY_BANDWIDTH * 1e3
    for method in args.methods:
        setup = MethodSetup(target=target, target_cache=tcache, backend=get_backend("triton"), draft=draft,
                            draft_cache=dcache, gamma=gamma, dustin=dustin)
        decoder = build_decoder(method, setup)
        config = GenerationConfig(max_new_tokens=args.rounds * (gamma + 1) * 3)
        tokens = torch.randint(0, target.config.vocab_size, (B,), device="cuda")
        if method == "vanilla":
            tcache.seqlens.fill_(L)
            step = tokens[:, None]
            for _ in range(3):
                decoder.decode_one_token(step)
            one_step = functools.partial(decoder.decode_one_token, step)
            ms = sorted(timed(one_step) for _ in range(args.rounds))[args.rounds // 2]
            rows.append({"method": method, "ms_per_step": ms, "tokens_per_s": B / ms * 1e3,
                         "floor_ms": floor_vanilla_ms, "fraction_of_floor": floor_vanilla_ms / ms})
            print(rows[-1])
            continue
        results = {}
        for profile in (False, True):
            tcache.seqlens.fill_(L)
            dcache.seqlens.fill_(L)
            state = decoder.start(tokens, tokens, B, config)
            timer = PhaseTimer(False, tcache.seqlens.device)
            for _ in range(3):  # warm-up: JIT and graph capture
                decoder.round(state, config, timer)
            timer = PhaseTimer(profile, tcache.seqlens.device)
            total = timed(lambda: [decoder.round(state, config, timer) for _ in range(args.rounds)])  # noqa: B023
            results[profile] = (total / args.rounds, timer.totals_ms())
        ms, _ = results[False]
        hist = state.hist.tolist()
        tau = sum((n + 1) * c for n, c in enumerate(hist)) / max(1, sum(hist))
        rows.append({"method": method, "ms_per_round": ms, "tau_random_weights": tau,
                     "phase_ms_per_round": {k: v / args.rounds for k, v in results[True][1].items()},
                     "verify_kv_bytes_full": kv_step, "vanilla_floor_ms": floor_vanilla_ms})
        print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (smollm2) / cached tokens (shapes)")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="smollm2: tokens generated per sequence")
    parser.add_argument("--rounds", type=int, default=20, help="shapes: timed rounds per method")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    if not torch.cuda.is_available():
        raise SystemExit("bench_round needs a CUDA device")
    target_spec, draft_spec, dustin = PAIRS[args.pair]
    max_pos = args.context + max(args.max_new_tokens, args.rounds * (args.gamma + 1) * 3) + 128
    target = load_model(target_spec, device="cuda", dtype=torch.bfloat16, max_positions=max_pos)
    draft = load_model(draft_spec, device="cuda", dtype=torch.bfloat16, max_positions=max_pos, seed=1).model
    if args.pair == "smollm2":
        rows = run_real(args, target.model, draft, target.tokenizer, dustin)
    else:
        rows = run_shape(args, target.model, draft, dustin)
    out = Path(args.out) if args.out else RESULTS / f"rounds_{args.pair}_h200.json"
    save_json(out, {**environment(), "pair": args.pair, "target": target.source, "draft": draft_spec,
                    "batch_size": args.batch_size, "context": args.context, "gamma": args.gamma,
                    "dustin_config": "hand-written placeholder, not searched: " + dustin.to_json(), "rows": rows})


if __name__ == "__main__":
    main()
