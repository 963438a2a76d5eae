"""End-to-end throughput at the real pair's measured tau (issue 24): the headline rows.

bench_e2e.py times every method's round at the paper's shapes with random weights, so its tokens/s is B x tau /
round time at a stated tau. A round's work has fixed shapes whatever it accepts, so the same measured round time
gives the throughput at any tau. This script takes the round times of an e2e run and the tau the real pair measured
(eval_tau.py on the test split, greedy: SmolLM2-135M + the packaged draft), and writes each row at

    tau_measured(method) = stated tau of Classic SD (the paper's, 2.7 for Llama-3.1-8B, Table 10)
                           x tau_real(method at its budget) / tau_real(classic)

pooled over the eval's windows (every family and context of the test split, greedy; the ratio per context is kept
beside it), the method at the e2e run's Γ over Classic SD at --classic-gamma. Classic SD itself stays at its stated
tau, vanilla at 1. Methods the eval did not measure (at that budget and Γ) get no measured row. Several --tau files
(of the same prompts file and --docs) are read as one; a corpus an eval marks unseen (`unseen_families`) is left out.
--replace takes a later eval of some methods (say, with another Dustin config): its rows take the place of the --tau
files' rows of the same method, budget, Γ and temperature, and its Classic SD must equal theirs (the same windows).

    python benchmarks/measured_tau.py --e2e benchmarks/results/fidelity/e2e_budget_llama-8b_h200.json \\
        --tau benchmarks/results/fidelity/tau_by_method_h200.json --out benchmarks/results/fidelity/headline.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from common import environment, save_json


def pooled_tau(rows: list[dict]) -> float:
    hist = [sum(col) for col in zip(*(r["committed_hist"] for r in rows), strict=True)]
    return sum((n + 1) * c for n, c in enumerate(hist)) / max(sum(hist), 1)


def measured_ratios(tau_rows: list[dict], temperature: float = 0.0, classic_gamma: int = 3
                    ) -> dict[tuple[str, int | None, int], dict]:
    """(method, budget, Γ) -> {ratio, per_context, windows}: the method's pooled tau over Classic SD's at
    classic_gamma on the same windows (every family and context of the eval, at `temperature`)."""
    rows = [r for r in tau_rows if r.get("temperature", 0.0) == temperature]
    by_key = defaultdict(list)
    for r in rows:
        by_key[row_key(r)[:3]].append(r)
    classic = by_key.get(("classic", None, classic_gamma))
    if not classic:
        raise SystemExit(f"--tau: the eval has no classic rows at Γ = {classic_gamma} (run eval_tau.py with "
                         f"--methods classic --gammas {classic_gamma} ...)")
    out = {}
    for (method, budget, gamma), mine in by_key.items():
        contexts = sorted({r["context"] for r in mine})
        per_context = {}
        for c in contexts:
            base = [r for r in classic if r["context"] == c]
            own = [r for r in mine if r["context"] == c]
            per_context[c] = {"tau": pooled_tau(own), "classic_tau": pooled_tau(base),
                              "ratio": pooled_tau(own) / pooled_tau(base), "windows": sum(r["windows"] for r in own)}
        base_all = [r for r in classic if r["context"] in contexts]
        out[(method, budget, gamma)] = {"tau": pooled_tau(mine), "classic_tau": pooled_tau(base_all),
                                 "ratio": pooled_tau(mine) / pooled_tau(base_all), "per_context": per_context}
    return out


def row_key(r: dict) -> tuple:
    """An eval row's (method, budget, Γ, temperature): what the ratios group by, and what --replace replaces."""
    return r["method"], r.get("budget"), r.get("gamma", 3), r.get("temperature", 0.0)


def replace_rows(tau_rows: list[dict], later: list[dict]) -> list[dict]:
    """tau_rows with every (method, budget, Γ, temperature) that `later` measured taken from `later` instead. Classic
    SD is the ratios' denominator, so where both have it, its tau must agree context by context (the same windows)."""
    for k, context in sorted({(row_key(r), r["context"]) for r in later if r["method"] == "classic"}, key=str):
        old = [r for r in tau_rows if row_key(r) == k and r["context"] == context]
        new = [r for r in later if row_key(r) == k and r["context"] == context]
        if old and abs(pooled_tau(old) - pooled_tau(new)) > 1e-9:
            raise SystemExit(f"--replace: its classic tau at context {context} (Γ = {k[2]}) is {pooled_tau(new):.4f}, "
                             f"the --tau files' {pooled_tau(old):.4f}; a replacement must be measured on the same "
                             "windows (the same prompts file and --docs)")
    replaced = {row_key(r) for r in later}
    return [r for r in tau_rows if row_key(r) not in replaced] + later


def headline_rows(e2e: dict, ratios: dict, classic_stated: float) -> list[dict]:
    rows = []
    vanilla = {(r["batch"], r["context"]): r for r in e2e["rows"] if r.get("method") == "vanilla"}
    for r in e2e["rows"]:
        if "ms_per_round" not in r:
            continue
        method, budget = r["method"], r.get("budget")
        out = {k: r.get(k) for k in ("batch", "context", "method", "budget", "ms_per_round", "tau_stated",
                                     "tokens_per_s", "speedup_vs_vanilla")}
        if method == "vanilla":
            measured = {"tau": 1.0, "ratio": None}
        else:
            found = ratios.get((method, budget, e2e.get("gamma", 3)))
            measured = {"tau": classic_stated * found["ratio"], "ratio": found["ratio"],
                        "per_context": found["per_context"]} if found else None
        if measured is not None:
            tokens = r["batch"] * measured["tau"] / r["ms_per_round"] * 1e3
            out.update(tau_measured=measured["tau"], measured_ratio=measured["ratio"],
                       tokens_per_s_measured_tau=tokens)
            base = vanilla.get((r["batch"], r["context"]))
            if base is not None:
                out["speedup_measured_tau"] = tokens / base["tokens_per_s"]
        rows.append(out)
    return rows


def markdown(rows: list[dict], classic_stated: float) -> str:
    lines = [f"Tokens/s (speedup over vanilla) at the measured tau (Classic SD's stated {classic_stated} x the real "
             "pair's ratio) and, in the last column, at the paper's stated tau per method.", "",
             "| batch | context | method | k | ms / round | measured tau | tokens/s at measured tau | "
             "stated tau | tokens/s at stated tau |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = (f"{r['tau_measured']:.2f} | {r['tokens_per_s_measured_tau']:.0f} "
                    f"({r.get('speedup_measured_tau', float('nan')):.2f}x)") if "tau_measured" in r else "- | -"
        stated = f"{r['tau_stated']:.2f}" if r.get("tau_stated") else "1"
        lines.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['budget'] or '-'} | "
                     f"{r['ms_per_round']:.2f} | {measured} | {stated} | {r['tokens_per_s']:.0f} "
                     f"({r.get('speedup_vs_vanilla', float('nan')):.2f}x) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e", type=Path, required=True, help="a bench_e2e.py JSON")
    parser.add_argument("--tau", type=Path, nargs="+", required=True,
                        help="eval_tau.py JSONs of the same windows, classic at --classic-gamma among their methods")
    parser.add_argument("--replace", type=Path, nargs="+", default=[],
                        help="eval_tau.py JSONs of the same windows whose rows replace the --tau files' rows of the "
                        "same method, budget, Γ and temperature (default: none)")
    parser.add_argument("--classic-gamma", type=int, default=3, help="Classic SD's Γ that the ratios divide by "
                        "(default: 3, the pair's)")
    parser.add_argument("--tau-fp8", type=Path, default=None,
                        help="an eval_tau.py --draft-kv-cache fp8 JSON on the same windows: its methods' rows give the "
                        "+fp8kv rows, each over the --tau file's (bf16) Classic SD")
    parser.add_argument("--classic-tau", type=float, default=2.7,
                        help="Classic SD's stated tau the ratios multiply (default: 2.7, the paper's Table 10 for "
                        "Llama-3.1-8B + 1B at batch 16, 32K)")
    parser.add_argument("--out", type=Path, required=True, help="JSON; a markdown table is written beside it")
    args = parser.parse_args()
    for path in (args.e2e, *args.tau, *args.replace):
        if not path.is_file():
            raise SystemExit(f"{path} does not exist")
    e2e, taus = json.loads(args.e2e.read_text()), [json.loads(path.read_text()) for path in args.tau]
    later = [json.loads(path.read_text()) for path in args.replace]
    unseen = {family for tau in taus + later for family in tau.get("unseen_families", [])}
    tau_rows = [r for tau in taus for r in tau["rows"] if r.get("family") not in unseen]
    if later:
        tau_rows = replace_rows(tau_rows, [r for tau in later for r in tau["rows"] if r.get("family") not in unseen])
    if args.tau_fp8 is not None:
        fp8 = json.loads(args.tau_fp8.read_text())
        if fp8.get("draft_kv_cache") != "fp8":
            raise SystemExit(f"--tau-fp8 {args.tau_fp8} was run with --draft-kv-cache {fp8.get('draft_kv_cache')}")
        tau_rows += [{**r, "method": r["method"] + "+fp8kv"} for r in fp8["rows"]]
    ratios = measured_ratios(tau_rows, classic_gamma=args.classic_gamma)
    rows = headline_rows(e2e, ratios, args.classic_tau)
    single = len(taus) == 1  # one file keeps the record's earlier form
    save_json(args.out, {**environment(), "e2e": str(args.e2e), "e2e_git_sha": e2e.get("git_sha"),
                         "tau": str(args.tau[0]) if single else [str(p) for p in args.tau],
                         "tau_git_sha": taus[0].get("git_sha") if single else [t.get("git_sha") for t in taus],
                         **({"replace": [str(p) for p in args.replace],
                             "replace_git_sha": [t.get("git_sha") for t in later]} if later else {}),
                         "unseen_families_left_out": sorted(unseen),
                         "tau_fp8": str(args.tau_fp8) if args.tau_fp8 else None,
                         "classic_stated_tau": args.classic_tau, "classic_gamma": args.classic_gamma,
                         "ratios": [{"method": m, "budget": k, "gamma": g, **v} for (m, k, g), v in sorted(
                             ratios.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2]))],
                         "rows": rows})
    table = markdown(rows, args.classic_tau)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
