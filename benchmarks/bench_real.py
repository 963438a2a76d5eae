"""End-to-end decoding speed with real weights on real prompts: every method and vanilla in one process.

Unlike bench_e2e.py (random weights at the paper's shapes, a stated tau), nothing here is stated: the pair decodes
held-out test windows (a prompts file from `eval_tau.py --save-prompts`) greedily, each method with its own runtime
(`build_runtime`, CUDA graphs), and the row reports what happened: committed tokens per second over the decoding
rounds, the measured tau, the round time and, from a second (profiling) run, each phase's time per round. The same
prompts go to every method of a (context, batch) cell, so tau and tokens/s compare like with like; greedy
speculative output must equal vanilla's, and the row says whether it did (the first tokens of every sequence).

Consistency check printed per row: committed tokens/s against B x tau / round time, and against B_active x tau /
round time, B_active being the sequences still decoding per round (the two differ by the sequences that finish
early; the rest by the first token, which comes from the prefill).

    python benchmarks/bench_real.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompts .carry/qwen_prompts.npz --dustin-config C.json --contexts 16384 32000 --batches 1 8 16 \\
        --methods vanilla classic dustin-ip-sparse-draft --out benchmarks/results/long_pair/e2e_real.json
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from common import RESULTS, environment, save_json
from eval_tau import FAMILIES, UNSEEN, load_documents, windows

from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.build import attention_backend, build_runtime
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.sampling import SamplingParams

COMPARED = 32  # leading tokens of each sequence compared with vanilla's (greedy output must be identical)


def prompts_for(documents: dict, families: list[str], context: int, count: int) -> list[tuple[str, list[int]]]:
    """`count` windows of `context` tokens, round-robin over the families: first the disjoint windows of
    eval_tau.windows, then, where the test documents hold too few, windows shifted by a quarter of the context
    (overlapping earlier ones but ending elsewhere, so their continuations differ); each id says its offset."""
    found: list[tuple[str, list[int]]] = []
    seen: set[str] = set()
    for shift in (0, context // 4, context // 2, 3 * context // 4):
        per_family = {}
        for f in families:
            shifted = [(doc_id, tokens[shift:]) for doc_id, tokens in documents[f]]
            per_family[f] = [(f"{f}:{w.split('@')[0]}@{shift + int(w.split('@')[1])}", t)
                             for w, t in windows(shifted, context, count)]
        rank = 0
        while len(found) < count and any(rank < len(v) for v in per_family.values()):
            for f in families:
                if rank < len(per_family[f]) and len(found) < count and per_family[f][rank][0] not in seen:
                    found.append(per_family[f][rank])
                    seen.add(per_family[f][rank][0])
            rank += 1
        if len(found) >= count:
            break
    return found


def run_cell(method: str, target, draft, dustin, prompts: list[list[int]], new_tokens: int, gamma: int,
             budget: int | None, device: torch.device, dtype: torch.dtype, backend, profile: bool) -> dict:
    max_len = max(len(p) for p in prompts) + new_tokens + gamma + 8
    decoder = build_runtime(method, target, draft=draft, dustin=dustin.with_budget(budget) if budget else dustin,
                            batch_slots=len(prompts), max_seq_len=max_len, dtype=dtype, device=device,
                            backend=backend, gamma=gamma)
    config = GenerationConfig(max_new_tokens=new_tokens, eos_token_ids=(), prefill_chunk=2048,
                              sampling=SamplingParams(0.0, 1.0, seed=0))
    result = decoder.generate(prompts, config)
    row = {"tokens_per_s": result.decode_tokens_per_s, "tau": result.tau if METHODS[method].speculative else 1.0,
           "rounds": result.decoding_rounds, "decoding_ms": result.decoding_ms, "prefill_ms": result.prefill_ms,
           "round_ms": result.decoding_ms / max(1, result.decoding_rounds), "committed_hist": result.committed_hist,
           "generated": result.generated, "head": [t[:COMPARED] for t in result.tokens]}
    if profile:
        profiled = decoder.generate(prompts, config, profile=True)
        row["phase_ms_per_round"] = {k: v / max(1, profiled.rounds) for k, v in profiled.phase_ms.items()}
    del decoder
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target model (a fetched name, a .gguf, a directory)")
    parser.add_argument("--draft", default=None, help="draft model of the methods that draft with one")
    parser.add_argument("--prompts", type=Path, required=True, help="test windows from eval_tau.py --save-prompts")
    parser.add_argument("--families", nargs="+", choices=[*FAMILIES, *UNSEEN], default=["books", "code", "fortunes"])
    parser.add_argument("--dustin-config", default=None, help="Dustin config of the dustin-* methods")
    parser.add_argument("--budget", type=int, default=None, help="Dustin's k (default: the config's)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=["vanilla", "classic"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32000], help="prompt tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-phase profiling run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_pair" / "e2e_real.json")
    args = parser.parse_args()
    need_draft = any(METHODS[m].needs_draft for m in args.methods)
    if need_draft and args.draft is None:
        raise SystemExit("--methods " + " ".join(args.methods) + " drafts with a model; pass --draft")
    if any(METHODS[m].needs_dustin for m in args.methods) and args.dustin_config is None:
        raise SystemExit("a dustin-* method needs --dustin-config (the target's searched config)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = max(args.contexts) + args.new_tokens + args.gamma + 8
    target = load_model(args.target, device=device, dtype=dtype, max_positions=max_len)
    draft = load_model(args.draft, device=device, dtype=dtype, max_positions=max_len,
                       share_with=target.model).model if need_draft else None
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    backend = attention_backend(device)
    documents = load_documents(args.prompts, None)
    started = environment()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: list[dict] = []

    def payload(complete: bool) -> dict:
        return {**started, "gpu": gpu, "target": target.source, "draft": args.draft, "new_tokens": args.new_tokens,
                "gamma": args.gamma, "dustin_config": dustin.to_json() if dustin else None,
                "families": args.families, "complete": complete, "rows": rows}

    for context in args.contexts:
        for batch in args.batches:
            found = prompts_for(documents, args.families, context, batch)
            if len(found) < batch:
                print(f"ctx {context} B {batch}: only {len(found)} test windows that long; skipped", flush=True)
                continue
            prompts = [p for _, p in found]
            reference = None
            for method in args.methods:
                budget = args.budget if METHODS[method].sparse else None
                t0 = time.perf_counter()
                row = run_cell(method, target.model, draft, dustin, prompts, args.new_tokens, args.gamma, budget,
                               device, dtype, backend, profile=not args.no_profile and batch == max(args.batches))
                head = row.pop("head")
                if method == "vanilla":
                    reference = head
                row.update(context=context, batch=batch, method=method, budget=budget, windows=[d for d, _ in found],
                           seconds=time.perf_counter() - t0,
                           same_as_vanilla=None if reference is None else head == reference,
                           expected_tokens_per_s=batch * row["tau"] / row["round_ms"] * 1e3)
                # sequences still decoding per round: those that accept more finish first, so the batch thins out
                row["active_batch"] = sum(row["committed_hist"]) / max(1, row["rounds"])
                row["expected_tokens_per_s_active"] = row["active_batch"] * row["tau"] / row["round_ms"] * 1e3
                rows.append(row)
                save_json(args.out, payload(False), quiet=True)
                print(f"ctx {context:5d} B {batch:2d} {method:24s} {row['tokens_per_s']:9.1f} tok/s  tau "
                      f"{row['tau']:.3f}  round {row['round_ms']:.2f} ms  (B*tau/round "
                      f"{row['expected_tokens_per_s']:.1f}; active {row['active_batch']:.2f} of {batch}: "
                      f"{row['expected_tokens_per_s_active']:.1f})  same as vanilla: {row['same_as_vanilla']}",
                      flush=True)
    save_json(args.out, payload(True))
    table = ["| context | B | method | tokens/s | x vanilla | tau | round ms | phases (ms per round) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((x for x in rows if x["method"] == "vanilla" and x["context"] == r["context"]
                     and x["batch"] == r["batch"]), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phase_ms_per_round", {}).items())
        table.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['tau']:.3f} | {r['round_ms']:.2f} | {phases} |")
    args.out.with_suffix(".md").write_text(f"GPU: {gpu}; git {started.get('git_sha')}; {started.get('date')}\n\n"
                                           + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
