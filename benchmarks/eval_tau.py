"""Mean accepted length tau of a target/draft pair on held-out text: books (Gutenberg) and code (CPython stdlib).

Each prompt is the first --context tokens of a test-split document (the final report is the only reader of that
split); the pair then generates --new-tokens greedily with --method (Classic SD by default) at Γ = --gamma, and
tau is the mean number of tokens committed per sequence per round. Runs on the CPU or the GPU.

    python benchmarks/eval_tau.py --draft path/to/checkpoint --context 4096 --docs 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, environment, save_json

from trtllm_dustin.attention import get_backend
from trtllm_dustin.data import as_encoder, final_report_documents
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.methods import MethodSetup, build_decoder
from trtllm_dustin.runtime.vanilla import GenerationConfig

FAMILIES = {"books": ("shakespeare", "milton"), "code": ("cpython_stdlib",)}


def prompts_for(family: str, tokenizer, context: int, docs: int) -> list[tuple[str, list[int]]]:
    encode = as_encoder(tokenizer)
    found = []
    for doc in final_report_documents(FAMILIES[family]):
        ids = encode(doc.text)
        if len(ids) >= context:
            found.append((doc.doc_id, ids[:context]))
        if len(found) == docs:
            break
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--method", default="classic", help="speculative method (dustin-* need --dustin-config)")
    parser.add_argument("--dustin-config", default=None, help="DustinConfig JSON for dustin methods")
    parser.add_argument("--docs", type=int, default=8, help="documents per family")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.context + args.new_tokens + args.gamma + 8
    target = load_model(args.target, device=device, dtype=dtype, max_positions=max_len)
    draft = load_model(args.draft, device=device, dtype=dtype, max_positions=max_len).model
    backend = get_backend("triton" if device.type == "cuda" else "reference")
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    results = {}
    for family in FAMILIES:
        prompts = prompts_for(family, target.tokenizer, args.context, args.docs)
        hist = [0] * (args.gamma + 1)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            batch = [p for _, p in prompts[i: i + args.batch_size]]
            setup = MethodSetup(target=target.model, backend=backend, draft=draft, gamma=args.gamma, dustin=dustin,
                                target_cache=KVCache.allocate(target.model.config, len(batch), max_len, dtype, device),
                                draft_cache=KVCache.allocate(draft.config, len(batch), max_len, dtype, device))
            result = build_decoder(args.method, setup).generate(batch, GenerationConfig(
                max_new_tokens=args.new_tokens, eos_token_ids=(), prefill_chunk=1024))
            hist = [a + b for a, b in zip(hist, result.committed_hist, strict=True)]
        rounds = sum(hist)
        tau = sum((n + 1) * c for n, c in enumerate(hist)) / rounds
        results[family] = {"tau": tau, "committed_hist": hist, "documents": [d for d, _ in prompts],
                           "seconds": time.perf_counter() - t0}
        print(f"{family}: tau {tau:.3f} over {rounds} sequence-rounds, {len(prompts)} documents, hist {hist}")
    out = Path(args.out) if args.out else RESULTS / "tau_smollm2.json"
    save_json(out, {**environment(), "target": target.source, "draft": args.draft, "context": args.context,
                    "new_tokens": args.new_tokens, "gamma": args.gamma, "decoding": f"greedy, {args.method}",
                    "dustin_config": dustin.to_json() if dustin else None,
                    "split": "test", "results": results})


if __name__ == "__main__":
    main()
