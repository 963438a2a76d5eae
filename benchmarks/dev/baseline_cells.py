"""Issue 35's acceptance 2 from a fidelity2 run's tables: in how many (task, context, budget, baseline) cells a method
scores at least as well as Quest and SnapKV, and which cells it loses.

    python benchmarks/dev/baseline_cells.py benchmarks/results/fidelity2/h200_run7 --method dustin-ip-sparse-draft

Reads the run's quality_fidelity2_h200.md (books, code, needle, vt, qa) and, where it exists,
quality_needle_new_h200.md (counted apart: the generalisation run).

--paired also reads the per-sample scores of quality_fidelity2_h200.json and gives each lost cell the paired
difference (method minus baseline, the same samples) with a 95 % bootstrap interval: a loss whose interval lies below
0 is one the samples show; the others are within what 60 samples can tell apart.

A sweep that ran only the method and FullKV (run_fidelity2_h200.sh sweep) is counted against another run's Quest and
SnapKV rows, on the same tasks file, with --baselines; its every task, needle-new included, is one table:

    python benchmarks/dev/baseline_cells.py benchmarks/results/fidelity2/h100_sweep_pooled/pooled_recent64/\
quality_pooled_recent64.md --baselines benchmarks/results/fidelity2/h200_run2
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

BASELINES = ("quest", "snapkv")
PRIMARY = {"books": "accuracy", "code": "exact_match", "needle": "string_match", "vt": "string_match",
           "qa": "string_match_part", "needle-new": "string_match"}  # eval_quality.py's task scores


def read_tables(path: Path) -> dict[tuple[str, str, int, str], float]:
    """(method, k, context, task) -> score from the per-context tables of an eval_quality.py markdown file."""
    out: dict[tuple[str, str, int, str], float] = {}
    context, tasks = None, None
    for line in path.read_text().splitlines():
        heading = re.match(r"### Context (\d+)", line)
        if heading:
            context, tasks = int(heading.group(1)), None
        elif line.startswith("| method | k |") and context is not None:
            tasks = [t.strip() for t in line.strip().strip("|").split("|")[2:]]
            tasks = None if "task mean" in tasks or "KL" in tasks else tasks
        elif tasks and line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != len(tasks) + 2:
                tasks = None
                continue
            for task, cell in zip(tasks, cells[2:], strict=True):
                out[(cells[0], cells[1], context, task)] = float(cell.split()[0])
        elif not line.strip():
            tasks = None
    return out


def count(scores: dict[tuple[str, str, int, str], float], method: str) -> tuple[int, int, list[str]]:
    """(cells won or tied, cells, the lost cells described) of `method` against every baseline."""
    won, total, lost = 0, 0, []
    for (name, k, context, task), value in sorted(scores.items()):
        if name != method:
            continue
        for baseline in BASELINES:
            other = scores.get((baseline, k, context, task))
            if other is None:
                continue
            total += 1
            if value >= other:
                won += 1
            else:
                lost.append(f"{task} {context // 1024}K k={k}: {value} < {baseline} {other}")
    return won, total, lost


def per_sample(path: Path) -> dict[tuple[str, str, int, str], dict[str, float]]:
    """(method, k, context, task) -> {sample id: primary score} from an eval_quality.py JSON (its records may split a
    cell over several files' worth of samples; they are joined)."""
    out: dict[tuple[str, str, int, str], dict[str, float]] = {}
    for record in json.loads(path.read_text())["records"]:
        k = "-" if record["budget"] in (None, "None") else str(record["budget"])
        metric = PRIMARY[record["task"]]
        cell = out.setdefault((record["method"], k, int(record["context"]), record["task"]), {})
        for sample, scores in zip(record["samples"], record["per_sample"], strict=True):
            cell[sample] = float(scores[metric])
    return out


def paired_interval(mine: dict[str, float], theirs: dict[str, float], draws: int = 10000, seed: int = 0
                    ) -> tuple[float, float, float, int]:
    """(mean difference, 95 % low, high, samples) of mine - theirs over the samples both scored, by a paired
    bootstrap (samples resampled with replacement, the same ones for both methods)."""
    shared = sorted(set(mine) & set(theirs))
    if not shared:
        raise ValueError("the two cells share no sample: they were not run on the same tasks file")
    diffs = [mine[s] - theirs[s] for s in shared]
    n, rng = len(diffs), random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return sum(diffs) / n, means[int(0.025 * draws)], means[int(0.975 * draws) - 1], n


def paired_losses(scores: dict, samples: dict, method: str) -> list[str]:
    """Each lost cell of `count` with its paired difference and interval (x 100), marked where the interval is
    below 0."""
    lines = []
    for (name, k, context, task), value in sorted(scores.items()):
        for baseline in BASELINES if name == method else ():
            other = scores.get((baseline, k, context, task))
            if other is None or value >= other:
                continue
            mine, theirs = samples.get((method, k, context, task)), samples.get((baseline, k, context, task))
            if mine is None or theirs is None:
                lines.append(f"{task} {context // 1024}K k={k} vs {baseline}: no per-sample scores")
                continue
            mean, low, high, n = paired_interval(mine, theirs)
            shown = "shown by the samples" if high < 0 else "within the samples' noise"
            lines.append(f"{task} {context // 1024}K k={k} vs {baseline}: {100 * mean:+.1f} [{100 * low:+.1f}, "
                         f"{100 * high:+.1f}] over {n} samples, {shown}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder under benchmarks/results/fidelity2/, or one "
                        "eval_quality.py markdown file (a sweep's)")
    parser.add_argument("--baselines", type=Path, default=None, help="a run folder whose Quest and SnapKV rows (its "
                        "main and needle-new tables) are the baselines, for a run that has none of its own")
    parser.add_argument("--method", default="dustin-ip-sparse-draft", help="the method to count")
    parser.add_argument("--paired", action="store_true", help="the lost cells' paired differences and 95 %% "
                        "bootstrap intervals, from the run's per-sample JSON")
    args = parser.parse_args()
    names = ("quality_fidelity2_h200.md", "quality_needle_new_h200.md")
    files = [args.run] if args.run.is_file() else [args.run / name for name in names if (args.run / name).is_file()]
    if not files or not (args.run.is_file() or files[0].name == names[0]):
        parser.error(f"{args.run / names[0]} does not exist; pass a run folder with eval_quality.py's tables")
    base_scores, base_samples = {}, {}
    for table in [args.baselines / name for name in names] if args.baselines else []:
        if table.is_file():
            base_scores.update({key: v for key, v in read_tables(table).items() if key[0] in BASELINES})
            if table.with_suffix(".json").is_file():
                base_samples.update(per_sample(table.with_suffix(".json")))
    for table in files:
        scores = {**base_scores, **read_tables(table)}
        won, total, lost = count(scores, args.method)
        print(f"{table.name}: {args.method} wins or ties {won} of {total} cells against {', '.join(BASELINES)}")
        for cell in lost:
            print(f"  lost: {cell}")
        data = table.with_suffix(".json")
        if args.paired and data.is_file():
            lines = paired_losses(scores, {**base_samples, **per_sample(data)}, args.method)
            print(f"  paired (x 100, {args.method} minus the baseline, 95 % bootstrap): "
                  f"{sum('shown by' in line for line in lines)} of {len(lines)} losses shown by the samples")
            for line in lines:
                print(f"    {line}")


if __name__ == "__main__":
    main()
