"""What sparse verification costs in quality: every method verifies the same draft's Γ tokens with budget k (issue 7).

Methods: classic (FullKV speculative decoding, the lossless reference), dustin-h/-t/-d, dustin-h-adaptive (input-aware
m), and the baselines streamingllm, snapkv, quest (runtime/selectors/), each at every --budgets k; dustin-h is also
swept over m = fraction x (k - sinks - recent) for --m-sweep, whose best per task is the oracle m.

Tasks (test split only, benchmarks/quality_tasks.py): books (teacher-forced next-token accuracy and KL(full || sparse)
along the held-out text, greedy tau of a free run), code (next-line exact match, edit similarity), needle (RULER-style
single / multikey / multivalue retrieval, string match), vt (variable tracking, string match) and qa (RULER-style
SQuAD / HotpotQA question answering among distractor paragraphs, string_match_part: any gold answer in the output).
95% CIs: Wilson for 0/1 metrics, percentile bootstrap over samples otherwise (over batches for tau).

Each batch is prefilled once; every method then starts from the same caches (decoding writes only past the prompt;
the draft's cache is restored before each method), so methods differ only in their verification sets.

    python benchmarks/eval_quality.py --draft preset:smollm2-draft-random --ignore-fingerprints   # reduced, CPU
    python benchmarks/eval_quality.py --save-tasks .carry/quality_tasks.json --contexts 4096 8192 --samples 60 \\
        --new-tokens 64                                                 # CPU, corpora installed; 53 s
    python benchmarks/eval_quality.py --tasks-file .carry/quality_tasks.json --draft smollm2-draft \\
        --contexts 4096 8192 --samples 60 --batch-size 60 --jobs 6 \\
        --out benchmarks/results/quality/quality_h200.json                                                 # GPU

Writes JSON (every sample's metrics), a markdown table beside it (.md) and a plot of accuracy vs budget (.png).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, environment, save_json
from quality_tasks import DEFAULT_TASKS, TASKS, Sample, as_dict, build_samples, sample_from_dict, score

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES, draft_kv_dtype
from trtllm_dustin.runtime.acceptors import TeacherForcedAcceptor
from trtllm_dustin.runtime.build import attention_backend, build_runtime
from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.prefill import prefill
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress
from trtllm_dustin.search.arr import scaled_m

DEFAULT_METHODS = ["classic", "dustin-h", "dustin-t", "dustin-d", "dustin-h-adaptive", "streamingllm", "snapkv",
                   "quest"]
BASELINES = ("streamingllm", "snapkv", "quest")
PRIMARY = {"books": "accuracy", "code": "exact_match", "repo-code": "exact_match", "needle": "string_match",
           "vt": "string_match", "qa": "string_match_part", "needle-new": "string_match"}
ORACLE_METRIC = {"books": ("kl", -1), "code": ("edit_similarity", 1), "repo-code": ("edit_similarity", 1),
                 "needle": ("string_match", 1), "vt": ("string_match", 1), "qa": ("string_match_part", 1),
                 "needle-new": ("string_match", 1)}  # the oracle m maximises sign * metric
PREFILL_CHUNK = 1024


# ---- confidence intervals -------------------------------------------------------------------------------------------
def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def bootstrap(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return float("nan"), float("nan")
    data = np.asarray(values, dtype=np.float64)
    means = data[np.random.default_rng(seed).integers(0, len(data), (resamples, len(data)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarise(values: list[float]) -> dict:
    binary = all(v in (0.0, 1.0) for v in values)
    lo, hi = wilson(sum(values), len(values)) if binary else bootstrap(values)
    return {"mean": float(np.mean(values)) if values else float("nan"), "ci95": [lo, hi], "n": len(values),
            "ci": "wilson" if binary else "bootstrap"}


# ---- one batch, prefilled once -----------------------------------------------------------------------------------
@dataclass
class Prefilled:
    prompts: list[list[int]]
    lens: torch.Tensor  # int32 [B]
    tcache: KVCache  # the prompts' target K/V; decoding only ever writes past them
    dcache: KVCache  # the draft's prefill, copied into `draft_work` before each method
    draft_work: KVCache
    first_logits: torch.Tensor  # [B, V] the target's prediction of the first new token (full attention)
    last_queries: dict[int, torch.Tensor]  # every target layer's query of the last prompt token


@torch.inference_mode()
def prefill_batch(target, draft, prompts: list[list[int]], max_len: int, dtype, device, backend,
                  draft_cache: str = "model") -> Prefilled:
    """draft_cache: the draft cache's dtype, one of DRAFT_KV_CHOICES (the models' dtype, or fp8)."""
    B = len(prompts)
    tcache = KVCache.allocate(target.config, B, max_len, dtype, device)
    dcache = KVCache.allocate(draft.config, B, max_len, draft_kv_dtype(draft_cache, dtype), device)
    logits, queries = prefill(target, tcache, backend, prompts, PREFILL_CHUNK, tuple(range(target.config.num_layers)))
    prefill(draft, dcache, backend, prompts, PREFILL_CHUNK)
    work = KVCache(dcache.k.clone(), dcache.v.clone(), dcache.seqlens.clone())
    return Prefilled(prompts, tcache.seqlens.clone(), tcache, dcache, work, logits, queries)


@torch.inference_mode()
def decode(decoder: Decoder, pre: Prefilled, new_tokens: int, teacher: list[list[int]] | None = None) -> dict:
    """Greedy decoding from the shared prefill, or teacher-forced along `teacher` (TeacherForcedAcceptor: the drafts
    are checked against the true continuation, whose log-probabilities are recorded): the decoder's own round
    either way. Returns the tokens, the accepted-count histogram, the log-probs and the m each active slot used."""
    B, device = len(pre.prompts), pre.lens.device
    slots = slice(0, B)
    pre.draft_work.k.copy_(pre.dcache.k)
    pre.draft_work.v.copy_(pre.dcache.v)
    decoder.prefilled(slots, pre.prompts, pre.last_queries)  # the caches hold the prompts: only the hooks run
    progress = Progress.allocate(B, new_tokens, decoder.gamma, (), device)
    sampling = SlotSampling.batch(SamplingParams(), B, device)
    acceptor, logprobs = None, None
    first_logits = decoder.shared_logits(pre.first_logits.clone())
    if teacher is None:
        first = first_logits.argmax(-1)
    else:
        forced = torch.full((B, new_tokens + decoder.gamma + 1), -1, dtype=torch.long, device=device)
        forced[:, :new_tokens] = torch.tensor(teacher, device=device)
        first = forced[:, 0]
        logprobs = torch.full((B, new_tokens, pre.first_logits.shape[-1]), float("nan"), device=device)
        logprobs[:, 0] = torch.log_softmax(first_logits.float(), -1)
        acceptor = TeacherForcedAcceptor(forced, logprobs)
    decoder.begin(progress, slots, first, pre.prompts, new_tokens)
    m_used = []
    for _ in range(new_tokens):
        active = progress.active.clone()
        decoder.round(progress, sampling, acceptor)
        share = decoder.selector.draft_share()  # Dustin's m per slot in this round's set
        if share is not None:
            m_used.extend(share[active].tolist())
        if not bool(progress.active.any()):  # evaluation, not timing: one host sync per round is fine
            break
    return {"tokens": progress.tokens(B), "hist": progress.hist.tolist(), "logprobs": logprobs, "m_used": m_used}


def book_metrics(method_lp: torch.Tensor, full_lp: torch.Tensor, truth: list[int]) -> dict[str, float]:
    """Over the verified positions 1..n-1 (position 0 comes from the shared full prefill)."""
    m, f = method_lp[1:], full_lp[1:]
    p_full = f.exp()
    kl = torch.where(p_full > 0, p_full * (f - m), 0.0).sum(-1)  # KL(full || sparse) per position
    target = torch.tensor(truth[1:], device=m.device)
    return {"accuracy": float((m.argmax(-1) == target).float().mean()), "kl": float(kl.mean()),
            "top1_agreement": float((m.argmax(-1) == f.argmax(-1)).float().mean())}


# ---- the run ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    key: str  # name in the results: the method, or dustin-h@m=<fraction> for the sweep
    method: str
    budget: int | None  # None: full verification
    m_fraction: float | None = None


def variants(methods: list[str], budgets: list[int], sweep: list[float]) -> list[Variant]:
    out = [Variant("classic", "classic", None)] if "classic" in methods else []
    for k in budgets:
        out += [Variant(m, m, k) for m in methods if m != "classic"]
        out += [Variant(f"dustin-h@m={f:g}", "dustin-h", k, f) for f in sweep]
    return out


def dustin_for(base: DustinConfig | None, variant: Variant) -> DustinConfig | None:
    """The Dustin config at the variant's budget: m carried over as the same share of the free slots, or swept."""
    if base is None or variant.budget is None:
        return base
    protected = base.n_sink + base.n_recent
    free = variant.budget - protected
    m = (round(variant.m_fraction * free) if variant.m_fraction is not None
         else scaled_m(base.m, variant.budget, base.budget, protected))
    return replace(base, budget=variant.budget, m=m)


def evaluate(args, target, tokenizer, draft, dustin: DustinConfig | None, samples: dict[tuple[str, int], list[Sample]],
             device, dtype, partial: Path | None = None) -> list[dict]:
    backend = attention_backend(device)  # shared by the prefill and every variant's decoder
    records = []
    for (task, context), task_samples in samples.items():
        new_tokens = args.new_tokens if task == "books" else args.answer_tokens
        for i in range(0, len(task_samples), args.batch_size):
            batch = task_samples[i: i + args.batch_size]
            if task == "books" and min(len(s.continuation) for s in batch) < new_tokens:
                new_tokens = min(len(s.continuation) for s in batch)  # a --tasks-file saved with fewer
                print(f"books @ {context}: the stored continuations hold {new_tokens} tokens; trajectories use "
                      f"{new_tokens} (re-save the tasks with --new-tokens {args.new_tokens} for longer ones)")
            prompts = [s.prompt for s in batch]
            max_len = max(len(p) for p in prompts) + new_tokens + args.gamma + 8
            pre = prefill_batch(target, draft, prompts, max_len, dtype, device, backend, args.draft_kv_cache)
            full_lp = None
            for variant in variants(args.methods, args.budgets, args.m_sweep):
                t0 = time.perf_counter()
                decoder = build_runtime(variant.method, target, draft=draft, dustin=dustin_for(dustin, variant),
                                        target_cache=pre.tcache, draft_cache=pre.draft_work, backend=backend,
                                        gamma=args.gamma, draft_budget=variant.budget or 512, use_cuda_graph=False)
                free = decode(decoder, pre, new_tokens)
                per_sample = []
                if task == "books":
                    forced = decode(decoder, pre, new_tokens, teacher=[s.continuation[:new_tokens] for s in batch])
                    if variant.method == "classic":
                        full_lp = forced["logprobs"]
                    if full_lp is None:
                        raise SystemExit("books needs classic (the FullKV reference) in --methods, listed first")
                    per_sample = [book_metrics(forced["logprobs"][b], full_lp[b], s.continuation[:new_tokens])
                                  for b, s in enumerate(batch)]
                else:
                    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in free["tokens"]]
                    per_sample = [score(s, text) for s, text in zip(batch, texts, strict=True)]
                    for metrics, text in zip(per_sample, texts, strict=True):
                        metrics["output"] = text
                hist = free["hist"]
                records.append({"task": task, "context": context, "key": variant.key, "method": variant.method,
                                "budget": variant.budget, "m_fraction": variant.m_fraction,
                                "m": free["m_used"][0] if len(set(free["m_used"])) == 1 else None,
                                "m_used_mean": float(np.mean(free["m_used"])) if free["m_used"] else None,
                                "committed_hist": hist, "samples": [s.sample_id for s in batch],
                                "kinds": [s.kind for s in batch], "per_sample": per_sample,
                                "seconds": time.perf_counter() - t0})
                tau = sum((n + 1) * c for n, c in enumerate(hist)) / max(sum(hist), 1)
                print(f"{task:6s} {context:5d} {variant.key:22s} k={variant.budget or 'full'!s:4s} tau {tau:.2f} "
                      + " ".join(f"{m} {np.mean([x[m] for x in per_sample]):.3f}" for m in per_sample[0]
                                 if m != "output") + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
            del pre
            if partial is not None:  # no lost work: a run cut short keeps every finished batch
                save_json(partial, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "records": records})
    return records


# ---- summary, table, plot --------------------------------------------------------------------------------------------
def summarise_records(records: list[dict]) -> dict:
    """(task, context, key, budget) -> metric -> {mean, ci95, n}; tau pooled over sequence-rounds."""
    grouped = defaultdict(list)
    for r in records:
        grouped[(r["task"], r["context"], r["key"], r["budget"])].append(r)
    summary = {}
    for (task, context, key, budget), rs in grouped.items():
        metrics = [m for m in rs[0]["per_sample"][0] if m != "output"]
        row = {m: summarise([s[m] for r in rs for s in r["per_sample"]]) for m in metrics}
        hists = [r["committed_hist"] for r in rs]
        taus = [sum((n + 1) * c for n, c in enumerate(h)) / max(sum(h), 1) for h in hists]
        pooled = [sum(col) for col in zip(*hists, strict=True)]
        row["tau"] = {"mean": sum((n + 1) * c for n, c in enumerate(pooled)) / max(sum(pooled), 1),
                      "ci95": list(bootstrap(taus)), "n": len(hists), "ci": "bootstrap over batches"}
        m_used = [r["m_used_mean"] for r in rs if r["m_used_mean"] is not None]
        row["m"] = rs[0]["m"]
        row["m_used_mean"] = float(np.mean(m_used)) if m_used else None
        summary[f"{task}|{context}|{key}|{budget}"] = row
    return summary


def _get(summary: dict, task: str, context: int, key: str, budget: int | None) -> dict | None:
    return summary.get(f"{task}|{context}|{key}|{budget}")


def _cell(row: dict | None, full: dict | None, task: str) -> str:
    """'value (delta to FullKV) [95% CI]' of the task's primary metric, x 100."""
    if row is None:
        return "-"
    metric = PRIMARY[task]
    value, (lo, hi) = 100 * row[metric]["mean"], row[metric]["ci95"]
    ci = f" [{100 * lo:.1f}, {100 * hi:.1f}]" if not math.isnan(lo) else ""
    delta = f" ({value - 100 * full[metric]['mean']:+.1f})" if full else ""
    return f"{value:.1f}{delta}{ci}"


def _goals(summary: dict, args, context: int, tasks: list[str], full: dict) -> list[str]:
    """The issue's acceptance goals, checked on the means (the intervals are in the table)."""
    lines = []
    top = max(args.budgets)
    mine_key = args.goal_method
    if not any(_get(summary, t, context, mine_key, k) for t in tasks for k in args.budgets):
        return ["Goals:", "", f"- {mine_key} is not in this run: no goal checked", ""]
    for t in tasks:
        ours = _get(summary, t, context, mine_key, top)
        if ours and full[t]:
            gap = 100 * (full[t][PRIMARY[t]]["mean"] - ours[PRIMARY[t]]["mean"])
            lines.append(f"- {t}: {mine_key} at k={top} is {gap:.1f} points below FullKV (goal: <= 1): "
                         f"{'met' if gap <= 1 else 'NOT met'}")
        if t == "books" and ours and full[t]:
            ratio = ours["tau"]["mean"] / full[t]["tau"]["mean"]
            lines.append(f"- books: {mine_key} tau at k={top} is {ratio:.1%} of FullKV's (goal: >= 97%): "
                         f"{'met' if ratio >= 0.97 else 'NOT met'}")
        worse = [(b, k) for k in args.budgets for b in BASELINES
                 if (row := _get(summary, t, context, b, k)) and (mine := _get(summary, t, context, mine_key, k))
                 and mine[PRIMARY[t]]["mean"] < row[PRIMARY[t]]["mean"]]
        lines.append(f"- {t}: {mine_key} >= every baseline at every budget: "
                     + ("met" if not worse else "NOT met (" + ", ".join(f"{b}@{k}" for b, k in worse) + ")"))
    return ["Goals:", "", *lines, ""]


def task_mean(summary: dict, context: int, tasks: list[str], key: str, budget: int | None) -> float | None:
    """The mean over tasks of each task's primary metric (x 100), or None when a task has no row."""
    rows = [_get(summary, t, context, key, budget) for t in tasks]
    if any(r is None for r in rows):
        return None
    return float(np.mean([100 * r[PRIMARY[t]]["mean"] for t, r in zip(tasks, rows, strict=True)]))


def _fidelity(summary: dict, args, context: int, tasks: list[str], full: dict) -> list[str]:
    """Task mean, books tau and KL of every method and budget against FullKV, and how much of Dustin-H's gap to the
    oracle each method closes at each budget (issue 24)."""
    full_mean = task_mean(summary, context, tasks, "classic", None)
    if full_mean is None:
        return []
    methods = [m for m in args.methods if m != "classic"]
    base_tau = full["books"]["tau"]["mean"] if full.get("books") else None
    lines = [f"Fidelity at {context}: the task mean (x 100) against FullKV's {full_mean:.1f}; books greedy tau as a "
             "share of FullKV's and KL(full || sparse); `closes` is the share of Dustin-H's task-mean gap to the "
             "oracle (one set for every layer and head) that the method closes at that budget.", "",
             "| method | k | task mean | vs FullKV | books tau | books KL | closes |", "|---|---|---|---|---|---|---|"]
    for k in args.budgets:
        ours = task_mean(summary, context, tasks, "dustin-h", k)
        oracle = task_mean(summary, context, tasks, "oracle", k)
        for m in methods:
            mean = task_mean(summary, context, tasks, m, k)
            if mean is None:
                continue
            books = _get(summary, "books", context, m, k)
            tau = f"{books['tau']['mean'] / base_tau:.1%}" if books and base_tau else "-"
            kl = f"{books['kl']['mean']:.4f}" if books else "-"
            closes = "-"
            if m not in ("dustin-h", "oracle") and ours is not None and oracle is not None and oracle != ours:
                closes = f"{(mean - ours) / (oracle - ours):+.0%}"
            lines.append(f"| {m} | {k} | {mean:.1f} | {mean - full_mean:+.1f} | {tau} | {kl} | {closes} |")
    return [*lines, ""]


def markdown(summary: dict, args, tasks_present: list[tuple[str, int]]) -> str:
    lines = []
    methods = [m for m in args.methods if m != "classic"]
    for context in sorted({c for _, c in tasks_present}):
        tasks = [t for t, c in tasks_present if c == context]
        lines += [f"### Context {context}: {', '.join(f'{t} {PRIMARY[t]}' for t in tasks)} (x 100, delta to FullKV)",
                  "", "| method | k | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
        full = {t: _get(summary, t, context, "classic", None) for t in tasks}
        lines.append("| classic (FullKV) | full | " + " | ".join(_cell(full[t], None, t) for t in tasks) + " |")
        for k in args.budgets:
            for m in methods:
                lines.append(f"| {m} | {k} | " + " | ".join(_cell(_get(summary, t, context, m, k), full[t], t)
                                                           for t in tasks) + " |")
        lines.append("")
        lines += _fidelity(summary, args, context, tasks, full)
        lines += _goals(summary, args, context, tasks, full)
        if "books" in tasks:
            lines += [f"Books at {context}: KL(full || sparse) in nats per token and greedy tau (ratio to FullKV).", "",
                      "| method | k | KL | top-1 agreement | tau |", "|---|---|---|---|---|"]
            base_tau = full["books"]["tau"]["mean"] if full["books"] else float("nan")
            rows = [("classic", None)] + [(m, k) for k in args.budgets for m in methods]
            for m, k in rows:
                row = _get(summary, "books", context, m, k)
                if row:
                    lines.append(f"| {m} | {k or 'full'} | {row['kl']['mean']:.4f} | "
                                 f"{row['top1_agreement']['mean']:.3f} | {row['tau']['mean']:.3f} "
                                 f"({row['tau']['mean'] / base_tau:.1%}) |")
            lines.append("")
        if args.m_sweep and "dustin-h" in args.methods:
            lines += [f"Input-aware m at {context}: the oracle is the best swept m for each task and budget "
                      "or the fixed m (books: lowest KL; code: edit similarity; needle, vt: string match; qa: any "
                      "answer matched); m is in positions of k - sinks - recent.", "",
                      "| task | k | fixed m | score | adaptive (mean m) | score | oracle m | score |",
                      "|---|---|---|---|---|---|---|---|"]
            for t in tasks:
                metric, sign = ORACLE_METRIC[t]
                for k in args.budgets:
                    fixed = _get(summary, t, context, "dustin-h", k)
                    adaptive = _get(summary, t, context, "dustin-h-adaptive", k)
                    sweep = [(f, _get(summary, t, context, f"dustin-h@m={f:g}", k)) for f in args.m_sweep]
                    sweep = [(f, r) for f, r in sweep if r]
                    if not (fixed and sweep):
                        continue
                    # The fixed m is one more candidate: the oracle is never worse than it.
                    f_best, best = max(sweep + [("fixed", fixed)], key=lambda fr: sign * fr[1][metric]["mean"])
                    ad = (f"{adaptive['m_used_mean']:.0f} | {adaptive[metric]['mean']:.4f}" if adaptive
                          else "- | -")
                    lines.append(f"| {t} | {k} | {fixed['m']} | {fixed[metric]['mean']:.4f} | {ad} | {best['m']} "
                                 f"({f_best if f_best == 'fixed' else f'x{f_best:g}'}) | {best[metric]['mean']:.4f} |")
            lines.append("")
    return "\n".join(lines)


def plot(summary: dict, args, tasks_present: list[tuple[str, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({c for _, c in tasks_present})  # one row of panels per context, one column per task
    tasks = list(dict.fromkeys(t for t, _ in tasks_present))
    fig, axes = plt.subplots(len(contexts), len(tasks), figsize=(4.2 * len(tasks), 3.6 * len(contexts)),
                             squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for task, context in tasks_present:
        ax = axes[contexts.index(context)][tasks.index(task)]
        ax.set_visible(True)
        metric = PRIMARY[task]
        full = _get(summary, task, context, "classic", None)
        if full:
            ax.axhline(100 * full[metric]["mean"], color="black", linestyle="--", label="FullKV (classic)")
        for m in [m for m in args.methods if m != "classic"]:
            rows = [(k, _get(summary, task, context, m, k)) for k in args.budgets]
            rows = [(k, r) for k, r in rows if r]
            if rows:
                ax.plot([k for k, _ in rows], [100 * r[metric]["mean"] for _, r in rows], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.budgets, [str(k) for k in args.budgets])
        ax.set_xlabel("budget k")
        ax.set_ylabel(f"{metric} x 100")
        ax.set_title(f"{task} @ {context}", fontsize=10)
    handles, labels = next(ax for ax in axes.flat if ax.get_visible()).get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0.06 / len(contexts), 1, 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- CLI ------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", default="smollm2-draft", help="draft model (default: the packaged distilled one)")
    parser.add_argument("--dustin-config", default=None,
                        help="default: the config searched for the packaged pair (trtllm_dustin/weights/smollm2_draft)")
    parser.add_argument("--ignore-fingerprints", action="store_true",
                        help="use the Dustin config with models it was not searched for (code-path runs only)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS, metavar="METHOD",
                        help=f"registered methods (default: {' '.join(DEFAULT_METHODS)}); one or more of "
                        f"{', '.join(METHODS)}")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(DEFAULT_TASKS),
                        help=f"default: {' '.join(DEFAULT_TASKS)} (needle-new: the generalisation run)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192] if cuda else [1024])
    parser.add_argument("--samples", "--docs", type=int, default=48 if cuda else 2, help="samples per task and context")
    parser.add_argument("--new-tokens", type=int, default=64 if cuda else 16, help="books: trajectory length")
    parser.add_argument("--answer-tokens", type=int, default=32 if cuda else 16, help="code/needle/vt/qa: generated")
    parser.add_argument("--m-sweep", type=float, nargs="*", default=[0, 0.25, 0.5, 0.75, 1] if cuda else [0, 1],
                        help="dustin-h's m as fractions of k - sinks - recent; the best is the oracle m")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--goal-method", default="dustin-h",
                        help="the method the markdown's goal checks are about (default: %(default)s)")
    parser.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model",
                        help="the draft's KV cache dtype: the model's, or fp8 (e4m3; the target's stays the model's)")
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-tasks", type=Path, default=None, help="write the task samples (token ids) and exit")
    parser.add_argument("--tasks-file", type=Path, default=None, help="samples from --save-tasks (no corpora needed)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality" / ("quality.json"))
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="combine the records of earlier runs (e.g. one per context) into --out; runs nothing")
    parser.add_argument("--jobs", type=int, default=1,
                        help="run the (context, task) cells as this many concurrent processes (<out>_<context>_<task>"
                             ".json each, then merged into --out): the 135M pair is launch-bound, so one GPU runs "
                             "several almost for free")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.merge:
        merge_runs(args.merge, args.out)
        return
    if args.jobs > 1 and len(args.contexts) * len(args.tasks) > 1:
        run_units_in_parallel(sys.argv[1:], work_units(args.tasks, args.contexts), args.out, args.jobs)
        return
    ring = [m for m in args.methods if METHODS[m].needs_ring]
    if ring:  # its ring is filled from the prefill's hidden states, which the shared prefill here does not keep
        parser.error(f"--methods {' '.join(ring)}: the ring drafter is measured by eval_tau.py --ring, not here")
    started = environment()  # the command, commit and date the run started from (not the one checked out at its end)
    if "classic" in args.methods:
        args.methods = ["classic"] + [m for m in args.methods if m != "classic"]
    elif "books" in args.tasks:
        parser.error("books compares against FullKV: keep classic in --methods")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    longest = max(args.contexts) + max(args.new_tokens, args.answer_tokens) + args.gamma + 8
    target = load_model(args.target, device=device, dtype=dtype, max_positions=longest)

    if args.tasks_file:
        stored = json.loads(args.tasks_file.read_text())
        samples = {(t, c): [sample_from_dict(s) for s in stored[f"{t}|{c}"][: args.samples]]
                   for t in args.tasks for c in args.contexts if f"{t}|{c}" in stored}
    else:
        samples = {(t, c): build_samples(t, target.tokenizer, c, args.samples, args.new_tokens, args.seed + c)
                   for t in args.tasks for c in args.contexts}
    for (t, c), ss in samples.items():
        print(f"{t} @ {c}: {len(ss)} samples, prompts {min(len(s.prompt) for s in ss)}-"
              f"{max(len(s.prompt) for s in ss)} tokens")
    if args.save_tasks:
        args.save_tasks.parent.mkdir(parents=True, exist_ok=True)
        args.save_tasks.write_text(json.dumps({f"{t}|{c}": [as_dict(s) for s in ss] for (t, c), ss in samples.items()}))
        print(f"wrote {args.save_tasks}")
        return
    if args.draft is None:
        parser.error("--draft is required to evaluate")
    draft = load_model(args.draft, device=device, dtype=dtype, max_positions=longest, share_with=target.model).model
    if args.dustin_config is None and args.target is None and args.draft == "smollm2-draft":
        from trtllm_dustin.models.loading import default_dustin_config_path

        args.dustin_config = str(default_dustin_config_path())
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    if dustin is not None and args.ignore_fingerprints:
        dustin = replace(dustin, target_fingerprint="", draft_fingerprint="")
    if dustin is not None:
        dustin = replace(dustin, gamma=args.gamma)
    t0 = time.perf_counter()
    records = evaluate(args, target.model, target.tokenizer, draft, dustin, samples, device, dtype,
                       partial=args.out.with_suffix(".partial.json"))
    summary = summarise_records(records)
    present = list(samples)
    table = markdown(summary, args, present)
    save_json(args.out, {**started, "target": target.source, "draft": args.draft,
                         "dustin_config": dustin.to_json() if dustin else None, "split": "test",
                         "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                         "seconds": time.perf_counter() - t0, "summary": summary, "records": records})
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    plot(summary, args, present, args.out.with_suffix(".png"))
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)


# The heaviest cells first, so the longest units do not start last: books decodes each method twice (free and
# teacher-forced) over 64 tokens; the others generate 32. Relative seconds of the 8K H200 run (quality_h200.json).
UNIT_COST = {"books": 228, "qa": 76, "needle": 70, "needle-new": 70, "vt": 55, "code": 47, "repo-code": 47}


def work_units(tasks: list[str], contexts: list[int]) -> list[tuple[int, str]]:
    """The (context, task) cells of a run, longest expected first (cost ~ task weight x context)."""
    cells = [(c, t) for c in contexts for t in tasks]
    return sorted(cells, key=lambda ct: -UNIT_COST.get(ct[1], 100) * ct[0])


def unit_commands(argv: list[str], units: list[tuple[int, str]], out: Path) -> list[tuple[list[str], Path]]:
    """This run's command line once per (context, task) unit (--contexts, --tasks, --out, --jobs replaced)."""
    several = {"--contexts": True, "--tasks": True, "--out": False, "--jobs": False}  # option -> takes several values?
    rest, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        name = arg.split("=", 1)[0]
        if name not in several:
            rest.append(arg)
        elif "=" not in arg:  # skip its value(s) too
            if several[name]:
                while i < len(argv) and not argv[i].startswith("-"):
                    i += 1
            else:
                i += 1
    runs = []
    for c, t in units:
        part = out.with_name(f"{out.stem}_{c}_{t}.json")
        runs.append(([sys.executable, str(Path(__file__).resolve()), *rest, "--contexts", str(c), "--tasks", t,
                      "--out", str(part)], part))
    return runs


def run_units_in_parallel(argv: list[str], units: list[tuple[int, str]], out: Path, jobs: int) -> None:
    """One process per (context, task) unit, `jobs` at a time, each logging to <part>.log; then --merge of them all.

    The 135M pair is launch-bound (the GPU idles between small kernels), so a few processes share one GPU almost
    for free; each child gets an equal share of the CPU threads so they do not oversubscribe the cores.
    """
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    pending, running, done = unit_commands(argv, units, out), [], []
    order = {part: n for n, (_, part) in enumerate(pending)}
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < jobs:
            cmd, part = pending.pop(0)
            log = open(part.with_suffix(".log"), "w")  # noqa: SIM115 (closed when the process ends)
            print(f"started: {' '.join(cmd)} (log {log.name})", flush=True)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), part, log))
        time.sleep(1)
        for proc, part, log in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, part, log))
            log.close()
            if proc.returncode != 0:
                for other, _, _ in running:
                    other.terminate()
                raise SystemExit(f"{part.name}: exit status {proc.returncode}; see {log.name} (finished batches are "
                                 f"in {part.with_suffix('.partial.json').name}; finished units: "
                                 f"{', '.join(p.name for p in done) or 'none'})")
            print(f"finished {part.name} after {time.perf_counter() - t0:.0f} s", flush=True)
            done.append(part)
    by_cell = sorted(done, key=lambda p: (units[order[p]][0], list(TASKS).index(units[order[p]][1])))
    wall = time.perf_counter() - t0
    merge_runs(by_cell, out, command="python benchmarks/eval_quality.py " + " ".join(argv), wall_seconds=wall)
    print(f"{len(units)} units in {wall:.0f} s with {jobs} processes")


def merge_runs(paths: list[Path], out: Path, command: str | None = None, wall_seconds: float | None = None) -> None:
    """One results file, table and plot from runs over disjoint (task, context) sets with the same methods.

    command / wall_seconds: the parallel run that made the parts (--jobs), recorded beside the merge itself.
    """
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    for p, run in zip(paths[1:], runs[1:], strict=True):
        for key in ("methods", "budgets", "m_sweep", "gamma"):
            if run["args"][key] != first["args"][key]:
                raise SystemExit(f"--merge: {p} has {key}={run['args'][key]}, {paths[0]} has {first['args'][key]}; "
                                 "merge only runs with the same methods, budgets, m sweep and gamma")
    seen, records = set(), []
    for p, run in zip(paths, runs, strict=True):
        cells = {(r["task"], r["context"]) for r in run["records"]}
        if cells & seen:
            raise SystemExit(f"--merge: {p} repeats task/context {sorted(cells & seen)}; give each cell once")
        seen |= cells
        records += run["records"]
    args = argparse.Namespace(**{"goal_method": "dustin-h", **first["args"], "contexts": sorted({c for _, c in seen}),
                                 "tasks": sorted({t for t, _ in seen})})
    present = sorted(seen, key=lambda tc: (tc[1], list(TASKS).index(tc[0])))
    summary = summarise_records(records)
    table = markdown(summary, args, present)
    merge_command = f"python benchmarks/eval_quality.py --merge {' '.join(p.name for p in paths)} --out {out.name}"
    save_json(out, {**{k: first[k] for k in first if k not in ("summary", "records", "args", "seconds")},
                    "command": command or merge_command, "merge_command": merge_command,
                    "wall_seconds": wall_seconds,
                    "merged_from": [{"file": p.name, "command": r.get("command"), "git_sha": r.get("git_sha"),
                                     "date": r.get("date"), "seconds": r.get("seconds")}
                                    for p, r in zip(paths, runs, strict=True)],
                    "args": vars(args), "seconds": sum(r.get("seconds", 0) for r in runs),  # summed over the parts
                    "summary": summary, "records": records})
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    plot(summary, args, present, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
