"""Issue 35's acceptance 2 from a fidelity2 run's tables: in how many (task, context, budget, baseline) cells a method
scores at least as well as Quest and SnapKV, and which cells it loses.

    python benchmarks/dev/baseline_cells.py benchmarks/results/fidelity2/h200_run7 --method dustin-ip-sparse-draft

Reads the run's quality_fidelity2_h200.md (books, code, needle, vt, qa) and, where it exists,
quality_needle_new_h200.md (counted apart: the generalisation run).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

BASELINES = ("quest", "snapkv")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder under benchmarks/results/fidelity2/")
    parser.add_argument("--method", default="dustin-ip-sparse-draft", help="the method to count")
    args = parser.parse_args()
    main_file = args.run / "quality_fidelity2_h200.md"
    if not main_file.is_file():
        parser.error(f"{main_file} does not exist; pass a run folder with eval_quality.py's tables")
    for name in ("quality_fidelity2_h200.md", "quality_needle_new_h200.md"):
        if (args.run / name).is_file():
            won, total, lost = count(read_tables(args.run / name), args.method)
            print(f"{name}: {args.method} wins or ties {won} of {total} cells against {', '.join(BASELINES)}")
            for cell in lost:
                print(f"  lost: {cell}")


if __name__ == "__main__":
    main()
