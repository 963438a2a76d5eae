"""Where a LongSpark drafter loses against the autoregressive draft, per slot, teacher-forced (CPU, about a minute).

Along test-split windows, every `--stride` positions L builds the drafter's block exactly as training does
(`training.longspark.anchor_logits`: boundary at L - 1, window rows [L - W, L), summary over [0, L)) and compares
slot g's proposal distribution with the target's at L + 1 + g:
- KL(target || drafter) per slot, with the Markov correction (teacher-forced: the true previous token), without it,
  and the correction alone;
- top-1 agreement per slot (a greedy round accepts slot g only if slots 0..g all agree), beside the AR draft's top-1
  at the same positions (teacher-forced too: it sees every true token before L + 1 + g, which the block cannot);
- the AR draft again with only the last W tokens before L (`--ar-windows`): how much context a next-token predictor
  of this size needs, against the block's W window rows;
- the same with one context input removed: no window rows (all invalid), no summary (every entry's bias -1e4), no
  boundary state (zeros), to show which input the proposals live on.

    python benchmarks/dev/longspark_slots.py --prompts .carry/test_prompts.npz --out slots.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, save_json  # noqa: E402

import trtllm_dustin.training.longspark as training  # noqa: E402
from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.models.longspark import load_longspark  # noqa: E402


def kl_top1(teacher: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """teacher, logits [..., V] -> KL(teacher || logits) and top-1 agreement [...] (fp32)."""
    t, s = F.log_softmax(teacher.float(), -1), F.log_softmax(logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1), (logits.argmax(-1) == teacher.argmax(-1)).float()


def slot_stats(teacher: torch.Tensor, logits: torch.Tensor) -> dict[str, list[float]]:
    """teacher, logits [N, G, V] -> per-slot mean KL(teacher || logits) and top-1 agreement."""
    kl, top1 = kl_top1(teacher, logits)
    return {"kl": [round(float(x), 4) for x in kl.mean(0)], "top1": [round(float(x), 4) for x in top1.mean(0)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="eval_tau.py --save-prompts file (test split)")
    parser.add_argument("--docs", nargs="+", default=["books/2", "books/3", "code/1", "essays/7"],
                        help="documents of the prompts file, each at least --context tokens long")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window (default: 1024)")
    parser.add_argument("--first", type=int, default=300, help="first anchor position (default: 300)")
    parser.add_argument("--stride", type=int, default=8, help="positions between anchors (default: 8)")
    parser.add_argument("--longspark", default=None, help="LongSpark checkpoint (default: the packaged one)")
    parser.add_argument("--draft", default="smollm2-draft", help="AR draft (default: the packaged one)")
    parser.add_argument("--ar-windows", type=int, nargs="*", default=[16, 64, 256],
                        help="also the AR draft given only this many tokens before L (default: 16 64 256)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    args = parser.parse_args()
    data = np.load(args.prompts)
    if any(w < 1 or w > args.first for w in args.ar_windows):
        raise SystemExit(f"--ar-windows {args.ar_windows}: each must be in [1, --first = {args.first}]")
    short = [d for d in args.docs if d not in data or len(data[d]) < args.context]
    if short:
        raise SystemExit(f"--docs {short}: not in {args.prompts} or shorter than --context {args.context}")
    t0 = time.perf_counter()
    target = load_model(None, dtype=torch.float32, max_positions=args.context + 16).model.eval()
    draft = load_model(args.draft, dtype=torch.float32, max_positions=args.context + 16, share_with=target).model.eval()
    spark = load_longspark(args.longspark, target).float()
    G = spark.config.block
    tokens = torch.stack([torch.from_numpy(data[d][: args.context].astype(np.int64)) for d in args.docs])
    anchors = torch.arange(args.first, args.context - G - 1, args.stride)
    rows = {}
    with torch.no_grad():
        feats = training.target_features(target, tokens, spark.config.target_layers)
        base, teacher, previous = training.anchor_logits(spark, target, tokens, anchors, feats=feats)
        markov = spark.markov_all(previous)
        rows["longspark"] = slot_stats(teacher, base + markov)
        rows["longspark without the Markov correction"] = slot_stats(teacher, base)
        rows["the Markov correction alone"] = slot_stats(teacher, markov)
        positions = anchors[:, None] + torch.arange(G)  # slot g predicts L + 1 + g: the AR draft's logits at L + g
        # the full vocabulary only at the scored positions (over a whole window it held GBs)
        ar = draft.full_vocab(draft.forward_train(tokens)[:, positions].float()).reshape(-1, G, teacher.shape[-1])
        rows["AR draft (sees every true token)"] = {"top1": slot_stats(teacher, ar)["top1"]}
        for w in args.ar_windows:  # tokens [L - w, L + G): the draft's logits at L + g predict L + 1 + g
            seqs = torch.stack([tokens[b, L - w: L + G] for b in range(len(args.docs)) for L in anchors.tolist()])
            cut = torch.cat([draft.full_vocab(draft.forward_train(seqs[i: i + 64])[:, w: w + G].float())
                             for i in range(0, len(seqs), 64)])
            rows[f"AR draft, only the last {w} tokens before L"] = {"top1": slot_stats(teacher, cut)["top1"]}

        window_rows = training.window_rows
        training.window_rows = lambda *a: (lambda r: (r[0], torch.zeros_like(r[1])))(window_rows(*a))
        try:
            b, _, _ = training.anchor_logits(spark, target, tokens, anchors, feats=feats)
        finally:
            training.window_rows = window_rows
        rows["longspark, no window rows"] = slot_stats(teacher, b + markov)
        bias = spark.summary_bias.detach().clone()
        spark.summary_bias.data.fill_(-1e4)
        try:
            b, _, _ = training.anchor_logits(spark, target, tokens, anchors, feats=feats)
        finally:
            spark.summary_bias.data.copy_(bias)
        rows["longspark, no summary"] = slot_stats(teacher, b + markov)
        no_boundary = {**feats, "hidden": {k: torch.zeros_like(v) for k, v in feats["hidden"].items()}}
        b, _, _ = training.anchor_logits(spark, target, tokens, anchors, feats=no_boundary)
        rows["longspark, no boundary state"] = slot_stats(teacher, b + markov)
    width = max(map(len, rows))
    print(f"{'per slot g':{width}s}  " + " ".join(f"{g:>6d}" for g in range(G)))
    for name, stats in rows.items():
        for key, values in stats.items():
            print(f"{name + ' ' + key:{width + 6}s}" + " ".join(f"{v:6.3f}" for v in values))
    if args.out:
        save_json(args.out, {**environment(), "docs": args.docs, "context": args.context, "anchors": len(anchors),
                             "blocks": len(anchors) * len(args.docs), "longspark": args.longspark or "packaged",
                             "draft": args.draft, "seconds": time.perf_counter() - t0, "rows": rows})


if __name__ == "__main__":
    main()
