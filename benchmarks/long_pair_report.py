"""The long pair's quality at 16K / 32K against FullKV, sample by sample: eval_quality.py's per-sample records (its
final or .partial.json files, one per run or unit; a sample measured twice keeps its first record) -> per task and
context, FullKV's own score, each method's score and its paired difference to FullKV with a 95 % bootstrap interval
over the samples (the same prompts under both), the task mean over the tasks FullKV can do (>= 20), and the books
fidelity (KL, top-1 agreement, greedy tau against FullKV's).

    python benchmarks/long_pair_report.py benchmarks/results/long_pair/h100/quality/*.json \\
        --out benchmarks/results/long_pair/h100/quality.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

PRIMARY = {"books": "accuracy", "code": "exact_match", "repo-code": "exact_match", "needle": "string_match",
           "vt": "string_match", "qa": "string_match_part", "needle-new": "string_match"}
DOABLE = 20.0  # a task FullKV scores under this (x 100) is reported, not counted in the task mean
RESAMPLES = 4000


def paired_interval(diffs: np.ndarray, seed: int = 0) -> tuple[float, float]:
    if len(diffs) < 2:
        return float("nan"), float("nan")
    means = diffs[np.random.default_rng(seed).integers(0, len(diffs), (RESAMPLES, len(diffs)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def collect(paths: list[Path]) -> tuple[dict, dict]:
    """(task, context, method key) -> {sample id: per-sample metrics}, and -> the cell's summed committed histogram."""
    scores: dict = defaultdict(dict)
    hists: dict = defaultdict(lambda: None)
    for path in paths:
        for r in json.loads(path.read_text())["records"]:
            key = r["key"] if r["budget"] is None else f"{r['key']} k={r['budget']}"
            cell = (r["task"], r["context"], key)
            for sample, metrics in zip(r["samples"], r["per_sample"], strict=True):
                scores[cell].setdefault(sample, metrics)
            hist = np.asarray(r["committed_hist"])
            hists[cell] = hist if hists[cell] is None else hists[cell] + hist
    return scores, hists


def tau(hist) -> float:
    return float((np.arange(1, len(hist) + 1) * hist).sum() / hist.sum()) if hist is not None and hist.sum() else \
        float("nan")


def report(paths: list[Path]) -> str:
    scores, hists = collect(paths)
    cells = sorted({(t, c) for t, c, _ in scores}, key=lambda x: (x[1], x[0]))
    keys = sorted({k for _, _, k in scores if k != "classic"})
    lines = ["| context | task | n | FullKV | " + " | ".join(f"{k} (paired diff, 95 % CI)" for k in keys) + " |",
             "|---|---|---|---|" + "---|" * len(keys)]
    means: dict = defaultdict(lambda: defaultdict(list))
    books = []
    for task, context in cells:
        full = scores.get((task, context, "classic"), {})
        metric = PRIMARY[task]
        row = []
        for key in keys:
            mine = scores.get((task, context, key), {})
            shared = sorted(set(full) & set(mine))
            if not shared:
                row.append("-")
                continue
            f = np.array([full[s][metric] for s in shared]) * 100
            m = np.array([mine[s][metric] for s in shared]) * 100
            lo, hi = paired_interval(m - f)
            row.append(f"{m.mean():.1f} ({m.mean() - f.mean():+.1f} [{lo:+.1f}, {hi:+.1f}])")
            means[context][key].append((task, m.mean() - f.mean(), f.mean()))
        n = len(full)
        fscore = np.mean([v[metric] for v in full.values()]) * 100 if full else float("nan")
        flag = "" if fscore >= DOABLE else " (under 20: not counted)"
        lines.append(f"| {context} | {task} | {n} | {fscore:.1f}{flag} | " + " | ".join(row) + " |")
        if task == "books":
            for key in keys:
                mine = scores.get((task, context, key), {})
                if mine:
                    kl = np.mean([v.get("kl", float("nan")) for v in mine.values()])
                    agree = np.mean([v.get("top1_agreement", float("nan")) for v in mine.values()])
                    t_full, t_mine = tau(hists[(task, context, "classic")]), tau(hists[(task, context, key)])
                    books.append(f"| {context} | {key} | {kl:.4f} | {agree:.3f} | {t_mine:.3f} / {t_full:.3f} "
                                 f"({100 * t_mine / t_full:.1f} %) |")
    lines += ["", "Task mean difference to FullKV (tasks FullKV scores >= 20; equal weight per task):", "",
              "| context | method | tasks | mean diff | worst task |", "|---|---|---|---|---|"]
    for context in sorted(means):
        for key in keys:
            counted = [(t, d) for t, d, f in means[context][key] if f >= DOABLE]
            if counted:
                worst = min(counted, key=lambda x: x[1])
                lines.append(f"| {context} | {key} | {', '.join(t for t, _ in counted)} | "
                             f"{np.mean([d for _, d in counted]):+.2f} | {worst[0]} {worst[1]:+.1f} |")
    if books:
        lines += ["", "Books: KL(full || sparse) per token, top-1 agreement with FullKV, greedy tau (method / FullKV):",
                  "", "| context | method | KL | top-1 agreement | tau |", "|---|---|---|---|---|", *books]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+", help="eval_quality.py JSON files (final or .partial.json)")
    parser.add_argument("--out", type=Path, default=None, help="markdown to write (default: print only)")
    args = parser.parse_args()
    text = report(args.files)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
