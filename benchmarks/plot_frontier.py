"""The quality-speed frontier of Dustin's budget k (issue 24): task-mean quality against round time.

Quality comes from eval_quality.py runs (the real pair, 4K and 8K test-split tasks: the mean over tasks of each task's
primary metric); the round time of the same k from a bench_e2e.py --budget run (Llama-3.1-8B + 3.2-1B shapes, random
weights, one H200). One curve per method, a point per k measured by both; FullKV (Classic SD) is a line at its quality
and a point at its round time; the oracle (an extra full pass per round, so no deployable cost) is drawn at Dustin-H's
round time of the same k. The default k is the largest whose round is within --cost-slack of k = 512's, so the best
quality that costs no more than that; the script prints it and each method's gap to FullKV there.

    python benchmarks/plot_frontier.py --quality benchmarks/results/fidelity/quality_fidelity_h200.json \\
        --e2e benchmarks/results/fidelity/e2e_budget_llama-8b_h200.json --out benchmarks/results/fidelity/frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval_quality import PRIMARY, task_mean

CURVES = ("dustin-h", "dustin-h-sparse-draft", "dustin-ip", "dustin-ip-pages", "dustin-ip-sparse-draft")


def _merged(summaries: list[dict]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for summary in summaries:  # later files win: list the main run last
        merged.update(summary)
    return merged


def only_tasks(summaries: list[dict], tasks: list[str] | None) -> list[dict]:
    """The summaries with only the rows of `tasks` (None: every row), so that a run with one more task (needle-new,
    say) adds its cells without taking the other runs' methods out of the task mean."""
    if tasks is None:
        return summaries
    return [{name: row for name, row in summary.items() if name.split("|")[0] in tasks} for summary in summaries]


def task_gaps(summaries: list[dict]) -> dict[tuple[int, str, int | None], dict[str, float]]:
    """(context, key, budget) -> task -> primary metric minus FullKV's, x 100."""
    merged = _merged(summaries)
    out: dict[tuple[int, str, int | None], dict[str, float]] = {}
    for name, row in merged.items():
        task, context, key, budget = name.split("|")
        full = merged.get(f"{task}|{context}|classic|None")
        if task in PRIMARY and full is not None and key != "classic":
            cell = (int(context), key, None if budget == "None" else int(budget))
            out.setdefault(cell, {})[task] = 100 * (row[PRIMARY[task]]["mean"] - full[PRIMARY[task]]["mean"])
    return out


def quality_means(summaries: list[dict]) -> dict[tuple[int, str, int | None], float]:
    """(context, key, budget) -> task mean x 100 over the tasks FullKV has at that context (rows missing one of
    them are left out)."""
    merged = _merged(summaries)
    cells, tasks = set(), {}
    for name in merged:
        task, context, key, budget = name.split("|")
        if task in PRIMARY:
            cells.add((int(context), key, None if budget == "None" else int(budget)))
            if key == "classic":
                tasks.setdefault(int(context), []).append(task)
    means = {cell: task_mean(merged, cell[0], tasks[cell[0]], cell[1], cell[2]) for cell in cells
             if cell[0] in tasks}
    return {cell: mean for cell, mean in means.items() if mean is not None}


def round_times(e2e: dict, batch: int, context: int) -> dict[tuple[str, int | None], float]:
    return {(r["method"], r.get("budget")): r["ms_per_round"] for r in e2e["rows"]
            if r.get("batch") == batch and r.get("context") == context and "ms_per_round" in r}


def default_choice(quality: dict, gaps: dict, times: dict, contexts: list[int], reference: tuple[str, int],
                   limit: float, goal: float, task_goal: float) -> dict:
    """The cheapest (method, k) of CURVES within `limit` of the reference round that meets both goals (module doc),
    else the one with the smallest worst task-mean gap; with every candidate's gaps."""
    ceiling = times[reference] * (1 + limit)
    rows = []
    for (method, k), ms in sorted(times.items(), key=lambda x: x[1]):
        if method not in CURVES or k is None or ms > ceiling:
            continue
        means = {c: quality.get((c, method, k)) for c in contexts}
        if any(v is None for v in means.values()):
            continue
        mean_gaps = {c: means[c] - quality[(c, "classic", None)] for c in contexts}
        worst_task = min(min(gaps.get((c, method, k), {}).values(), default=0.0) for c in contexts)
        meets = min(mean_gaps.values()) >= -goal and worst_task >= -task_goal
        rows.append({"method": method, "budget": k, "round_ms": ms, "gap_to_fullkv": mean_gaps,
                     "worst_task_gap": worst_task, "meets_goals": meets})
    if not rows:
        raise SystemExit(f"no point of {CURVES} within {limit:.0%} of {reference}'s round has quality at every context")
    met = [r for r in rows if r["meets_goals"]]
    pick = met[0] if met else max(rows, key=lambda r: min(r["gap_to_fullkv"].values()))
    return {"choice": pick, "candidates": rows, "ceiling_ms": ceiling, "reference": list(reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quality", type=Path, nargs="+", required=True, help="eval_quality.py JSONs (main run last)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=sorted(PRIMARY),
                        help="the tasks of the task mean (default: every task FullKV has at the context)")
    parser.add_argument("--e2e", type=Path, required=True, help="bench_e2e.py --budget JSON")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--e2e-context", type=int, default=32768, help="the context whose round times are used")
    parser.add_argument("--reference", default="dustin-h@1024",
                        help="METHOD@K whose round the cost limit is relative to (default: %(default)s)")
    parser.add_argument("--cost-limit", type=float, default=0.05,
                        help="allowed round-time growth over the reference's (default: %(default)s)")
    parser.add_argument("--goal", type=float, default=1.0,
                        help="task-mean points below FullKV allowed at every context (default: %(default)s)")
    parser.add_argument("--task-goal", type=float, default=3.0,
                        help="points below FullKV allowed on every task (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="PNG; the numbers go to a .json beside it")
    args = parser.parse_args()
    for path in [*args.quality, args.e2e]:
        if not path.is_file():
            raise SystemExit(f"{path} does not exist")
    summaries = only_tasks([json.loads(p.read_text())["summary"] for p in args.quality], args.tasks)
    quality, gaps = quality_means(summaries), task_gaps(summaries)
    e2e = json.loads(args.e2e.read_text())
    times = round_times(e2e, args.batch, args.e2e_context)
    method, _, budget = args.reference.partition("@")
    reference = (method, int(budget)) if budget.isdigit() else None
    if reference not in times:
        raise SystemExit(f"{args.e2e}: no {args.reference} row at batch {args.batch}, context {args.e2e_context}")
    contexts = sorted({c for c, _, _ in quality})
    default = default_choice(quality, gaps, times, contexts, reference, args.cost_limit, args.goal, args.task_goal)
    report = {"e2e": str(args.e2e), "e2e_git_sha": e2e.get("git_sha"), "quality": [str(p) for p in args.quality],
              "tasks": args.tasks,
              "batch": args.batch, "e2e_context": args.e2e_context, "cost_limit": args.cost_limit, "goal": args.goal,
              "task_goal": args.task_goal,
              "round_ms": [{"method": m, "budget": k, "ms": ms} for (m, k), ms in sorted(times.items(),
                                                                                      key=lambda x: (x[0][0],
                                                                                                     x[0][1] or 0))],
              "task_mean": [{"context": c, "method": m, "budget": k, "mean": v}
                            for (c, m, k), v in sorted(quality.items(), key=lambda x: (x[0][0], x[0][1],
                                                                                       x[0][2] or 0))],
              "default": default}
    for row in default["candidates"]:
        print(f"{row['method']} k = {row['budget']}: {row['round_ms']:.2f} ms; task mean vs FullKV "
              + ", ".join(f"{c}: {g:+.1f}" for c, g in row["gap_to_fullkv"].items())
              + f"; worst task {row['worst_task_gap']:+.1f}" + (" (meets the goals)" if row["meets_goals"] else ""))
    pick = default["choice"]
    print(f"default: {pick['method']} at k = {pick['budget']} ({pick['round_ms']:.2f} ms, within "
          f"{args.cost_limit:.0%} of {args.reference}'s {times[reference]:.2f} ms"
          + ("" if pick["meets_goals"] else "; no candidate meets the goals, this one misses them least") + ")")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(contexts), figsize=(6.2 * len(contexts), 4.6), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        full = quality[(context, "classic", None)]
        ax.axhline(full, color="black", linestyle="--", label="FullKV (Classic SD)")
        if ("classic", None) in times:
            ax.plot([times[("classic", None)]], [full], marker="s", color="black", linestyle="none")
        for method, style in zip((*CURVES, "oracle"), ("-o", "-o", "-s", "-s", "-s", ":^"), strict=True):
            clock = "dustin-h" if method == "oracle" else method
            points = sorted((k, times[(clock, k)], quality[(context, method, k)]) for (c, m, k) in quality
                            if c == context and m == method and (clock, k) in times)
            if not points:
                continue
            label = "oracle (quality ceiling, at Dustin-H's round time)" if method == "oracle" else method
            ax.plot([p[1] for p in points], [p[2] for p in points], style, label=label)
            for k, ms, mean in points if method != "oracle" else []:
                ax.annotate(f"k={k}", (ms, mean), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlabel(f"round time, ms (Llama-3.1-8B + 1B shapes, B = {args.batch}, {args.e2e_context // 1024}K, H200)")
        ax.set_ylabel("task mean (x 100), SmolLM2-135M pair")
        ax.set_title(f"quality at {context // 1024}K against round time at {args.e2e_context // 1024}K", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
