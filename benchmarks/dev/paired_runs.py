"""Paired differences between quality runs over the same samples (eval_quality.py JSONs with the same tasks file or
seed): every (task, budget) cell of each method against FullKV, and each later run's methods against the first
run's, with a 95 % percentile bootstrap over the samples. It is how a config change (say, the recent window) is
told apart from sampling noise when each run has a different --dustin-config.

    python benchmarks/dev/paired_runs.py base.json recent64=r64.json recent32=r32.json
    python benchmarks/dev/paired_runs.py base.json,base_needle_new.json recent64=r64.json   # a base in two files
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

METRIC = {"books": "accuracy", "code": "exact_match", "needle": "string_match", "needle-new": "string_match",
          "vt": "string_match", "qa": "string_match_part"}


def per_sample(path: Path, tag: str) -> dict[tuple[str, int, str, int | None], dict[str, float]]:
    """(task, context, method key with its run's tag, budget) -> {sample id: the task's metric}."""
    out: dict[tuple[str, int, str, int | None], dict[str, float]] = {}
    for record in json.loads(path.read_text())["records"]:
        metric = METRIC[record["task"]]
        key = record["key"] if record["budget"] is None else f"{record['key']}{tag}"
        cell = out.setdefault((record["task"], record["context"], key, record["budget"]), {})
        for sample, values in zip(record["samples"], record["per_sample"], strict=True):
            cell[sample] = values[metric]
    return out


def paired(a: dict[str, float], b: dict[str, float], draws: int = 2000,
           seed: int = 0) -> tuple[float, float, float, int]:
    """Mean of a - b over the samples both hold (x 100), its 95 % bootstrap interval, and the count."""
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit("the two cells share no sample: were the runs made on the same tasks and seed?")
    diffs = [a[s] - b[s] for s in common]
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(draws))
    lo, hi = means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
    return 100 * sum(diffs) / len(diffs), 100 * lo, 100 * hi, len(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the reference run (its FullKV rows are the reference of every run); several "
                        "files joined by commas (a run and its separate needle-new run, say) are read as one run")
    parser.add_argument("others", nargs="*", help="NAME=PATH: a run whose methods are compared with the base's")
    args = parser.parse_args()
    cells = {}
    for path in args.base.split(","):
        cells.update(per_sample(Path(path), ""))
    names = []
    for other in args.others:
        name, sep, path = other.partition("=")
        if not sep:
            parser.error(f"{other!r}: give NAME=PATH")
        names.append(name)
        cells.update({k: v for k, v in per_sample(Path(path), f"/{name}").items() if k[3] is not None})
    print("| task | context | k | method | minus FullKV | minus the base's same method | minus each base method |")
    print("|---|---|---|---|---|---|---|")
    for (task, context, key, budget) in sorted(cells, key=lambda c: (c[0], c[1], c[3] or 0, c[2])):
        if budget is None:
            continue
        full = cells.get((task, context, "classic", None))
        if full is None:
            raise SystemExit(f"{args.base}: no FullKV (classic) rows for {task} @ {context}")
        m, lo, hi, n = paired(cells[(task, context, key, budget)], full)
        same = rest = ""
        if "/" in key:
            method = key.split("/")[0]
            if (task, context, method, budget) in cells:
                d = paired(cells[(task, context, key, budget)], cells[(task, context, method, budget)])
                same = f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"
            others = [b for (t, c, b, k) in sorted(cells) if (t, c, k) == (task, context, budget) and "/" not in b
                      and b != method]
            rest = "; ".join(f"{b}: {d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]" for b in others for d in
                             [paired(cells[(task, context, key, budget)], cells[(task, context, b, budget)])])
        print(f"| {task} | {context} | {budget} | {key} | {m:+.1f} [{lo:+.1f}, {hi:+.1f}] (n {n}) | {same} | {rest} |")


if __name__ == "__main__":
    main()
