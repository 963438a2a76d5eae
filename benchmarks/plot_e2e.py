"""Merge the per-pair end-to-end results into e2e_h200.json/.csv and draw the speedup and phase plots.

    python benchmarks/plot_e2e.py            # reads benchmarks/results/e2e_<pair>_h200.json
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAIRS = {"llama-8b": "Llama-3.1-8B + 3.2-1B (stated tau 2.8)", "qwen-7b": "Qwen2.5-7B + 0.5B (stated tau 2.2)",
         "qwen-14b": "Qwen2.5-14B + 0.5B (stated tau 2.2)"}
STYLE = {"vanilla": ("black", ":"), "classic": ("tab:gray", "--"), "magicdec": ("tab:blue", "-."),
         "dustin-h": ("tab:red", "-"), "dustin-h-sparse-draft": ("tab:orange", "-"),
         "classic+fp8kv": ("tab:gray", ":"), "dustin-h+fp8kv": ("tab:red", "--")}
PHASES = ("draft", "estimate", "select", "verify", "accept")


def load() -> dict[str, dict]:
    runs = {}
    for pair in PAIRS:
        path = RESULTS / f"e2e_{pair}_h200.json"
        if path.is_file():
            runs[pair] = json.loads(path.read_text())
    return runs


def merge(runs: dict[str, dict]) -> None:
    rows = [{"pair": pair, **row} for pair, run in runs.items() for row in run["rows"]]
    keys = ("command", "gpu", "git_sha", "date", "torch")
    runs_meta = {pair: {k: run[k] for k in keys} for pair, run in runs.items()}
    merged = {"reproduce": "bash benchmarks/run_e2e_h200.sh (the three bench_e2e.py commands in 'runs', then "
                           "plot_e2e.py)", "runs": runs_meta, "rows": rows}
    (RESULTS / "e2e_h200.json").write_text(json.dumps(merged, indent=2) + "\n")
    with open(RESULTS / "e2e_h200.csv", "w", newline="") as f:
        fields = ["pair", "batch", "context", "method", "tokens_per_s", "speedup_vs_vanilla", "ms_per_round",
                  "tau_stated", "tau_realized", "floor_ms", "fraction_of_floor", "skipped"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot_speedups(runs: dict[str, dict]) -> None:
    batches = sorted({r["batch"] for run in runs.values() for r in run["rows"]})
    fig, axes = plt.subplots(len(runs), len(batches), figsize=(5.5 * len(batches), 3.6 * len(runs)), squeeze=False)
    for i, (pair, run) in enumerate(runs.items()):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            for method, (color, dash) in STYLE.items():
                pts = sorted((r["context"], r["speedup_vs_vanilla"]) for r in run["rows"]
                             if r.get("method") == method and r["batch"] == batch and "speedup_vs_vanilla" in r)
                if pts:
                    ax.plot([c // 1024 for c, _ in pts], [s for _, s in pts], dash, color=color, marker="o",
                            label=method)
            if not ax.lines:
                ax.text(0.5, 0.5, "not run: target + draft KV caches do not fit on one H200", ha="center",
                        va="center", transform=ax.transAxes, fontsize=8)
            ax.set_title(f"{PAIRS[pair]}, batch {batch}", fontsize=9)
            ax.set_xlabel("context (K tokens)")
            ax.set_ylabel("speedup over vanilla")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Decoding speedup on one H200 (random weights of the real shapes; accepted counts drawn at the "
                 "stated tau)", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "e2e_speedup_h200.png", dpi=110)


def plot_phases(runs: dict[str, dict], pair: str = "llama-8b", batch: int = 16, context: int = 32768) -> None:
    rows = [r for r in runs[pair]["rows"] if r.get("batch") == batch and r.get("context") == context
            and "phase_ms_per_round" in r]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for y, row in enumerate(rows):
        left = 0.0
        for phase, color in zip(PHASES, ("tab:blue", "tab:purple", "tab:pink", "tab:red", "tab:gray"), strict=True):
            ms = row["phase_ms_per_round"].get(phase, 0.0)
            ax.barh(y, ms, left=left, color=color, label=phase if y == 0 else None)
            left += ms
        ax.text(left + 0.3, y, f"{left:.1f} ms / round", va="center", fontsize=8)
    vanilla = next(r for r in runs[pair]["rows"] if r.get("method") == "vanilla" and r["batch"] == batch
                   and r["context"] == context)
    ax.axvline(vanilla["ms_per_round"], color="black", linestyle=":", label="vanilla step")
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows], fontsize=8)
    ax.set_xlabel("milliseconds per round (CUDA events, profiling pass)")
    ax.set_title(f"{PAIRS[pair]}: one round at batch {batch}, {context // 1024}K context", fontsize=9)
    ax.set_xlim(0, max(r["ms_per_round"] for r in rows) * 1.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(RESULTS / "e2e_phases_h200.png", dpi=110)


def headline(runs: dict[str, dict]) -> str:
    """Markdown table: tokens/s and speedup per method at each context, batch 16 (batch 8 for 14B)."""
    lines = []
    for pair, run in runs.items():
        batch = max(r["batch"] for r in run["rows"] if "tokens_per_s" in r)
        contexts = sorted({r["context"] for r in run["rows"] if r["batch"] == batch and "tokens_per_s" in r})
        lines.append(f"\n**{PAIRS[pair]}, batch {batch}** (tokens/s, speedup over vanilla)\n")
        lines.append("| method | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |")
        lines.append("| --- |" + " --- |" * len(contexts))
        for method in STYLE:
            cells = []
            for c in contexts:
                r = next((r for r in run["rows"] if r.get("method") == method and r["batch"] == batch
                          and r["context"] == c), None)
                cells.append("" if r is None else f"{r['tokens_per_s']:.0f} ({r['speedup_vs_vanilla']:.2f}x)")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    runs = load()
    merge(runs)
    plot_speedups(runs)
    plot_phases(runs)
    (RESULTS / "e2e_h200_table.md").write_text(headline(runs))
    print(headline(runs))


if __name__ == "__main__":
    main()
