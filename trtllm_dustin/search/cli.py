"""Command line of the offline search: `srh` (profile SRHs), `arr` (ARR analysis and plots), `search` (Algorithm 1),
`search-layers` (the in-pass selection layers, search/in_pass.py).

`trtllm_dustin.cli` mounts these as `trtllm-dustin srh|arr|search`; `python -m trtllm_dustin.search.cli` runs them
on their own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.models import LoadedModel, ModelLoadError, load_model
from trtllm_dustin.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL
from trtllm_dustin.provenance import Provenance
from trtllm_dustin.search.algorithm import SearchRecord, SearchSettings, dustin_config, run_search
from trtllm_dustin.search.arr import ARREvaluator, scaled_m
from trtllm_dustin.search.arr_kl import ARRKLSettings, arr_kl_points, summarise
from trtllm_dustin.search.attention_trace import AttentionTrace, TraceSettings, collect_trace, validation_windows
from trtllm_dustin.search.in_pass import InPassObjective, InPassSettings, SearchTraces, search_selection_layers
from trtllm_dustin.search.plots import plot_arr_kl, plot_arr_vs_budget, plot_layerwise, plot_srh_scores
from trtllm_dustin.search.srh import SRHResult, SRHSettings, identify_srh

__all__ = [
    "add_arr_arguments",
    "add_search_arguments",
    "add_layers_arguments",
    "add_srh_arguments",
    "arr_command",
    "layers_command",
    "build_parser",
    "main",
    "search_command",
    "srh_command",
]

CURVE_BUDGETS = (32, 64, 128, 192, 256, 384, 512, 1024)


def _device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    return device


def add_srh_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to profile (default: SmolLM2-135M); forms as in generate")
    parser.add_argument("--tokenizer-from", default=None,
                        help="load the tokenizer from this model instead (a draft preset uses its target's)")
    parser.add_argument("--out", type=Path, required=True, help="SRH JSON to write")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(SRHSettings.context_lengths),
                        help="prompt lengths in tokens (the issue asks for >= 10 up to the window)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(SRHSettings.depths),
                        help="needle depths in [0, 1] (the issue asks for >= 10 from 0 to 1)")
    parser.add_argument("--needles", type=int, default=SRHSettings.needles, help="distinct needles (>= 3)")
    parser.add_argument("--max-new-tokens", type=int, default=SRHSettings.max_new_tokens)
    parser.add_argument("--min-recall", type=float, default=SRHSettings.min_recall,
                        help="a test counts when the answer's ROUGE-1 recall is above this (-1: count every test)")
    parser.add_argument("--heads-per-layer", type=int, default=SRHSettings.heads_per_layer)
    parser.add_argument("--batch", type=int, default=SRHSettings.batch, help="prompts decoded together")
    parser.add_argument("--note", default="", help="stored in the JSON (e.g. 'random weights: meaningless')")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random-weight presets")


def srh_command(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    device = _device(args.device)
    provenance = Provenance.capture(device)
    settings = SRHSettings(context_lengths=tuple(args.lengths), depths=tuple(args.depths), needles=args.needles,
                           max_new_tokens=args.max_new_tokens, min_recall=args.min_recall,
                           heads_per_layer=args.heads_per_layer, batch=args.batch)
    source = None  # the target: a draft's tokenizer, and the embedding a shared-embedding draft takes from it
    if args.tokenizer_from is not None or args.model == DEFAULT_DRAFT:
        source = load_model(args.tokenizer_from or DEFAULT_MODEL, device=device)
    loaded = load_model(args.model, device=device, seed=args.seed, share_with=source.model if source else None)
    tokenizer = source.tokenizer if source is not None else loaded.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{loaded.source} has no tokenizer; pass --tokenizer-from with its target model")
    result = identify_srh(loaded.model, tokenizer, settings, note=args.note)
    result = replace(result, provenance=provenance.finished(time.perf_counter() - start).to_dict())
    result.save(args.out)
    if result.layers:
        plot_srh_scores(json.loads(result.to_json())["head_scores"], args.out.with_suffix(".png"),
                        f"SRH scores of {result.model} ({result.counted}/{len(result.tests)} tests counted)")
    print(f"{len(result.tests)} tests, {result.counted} counted (ROUGE-1 recall > {settings.min_recall}); "
          f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    if not result.layers:
        print("warning: no test counted, so no SRHs were chosen; lower --min-recall or shorten --lengths",
              file=sys.stderr)
    for lh in result.layers:
        print(f"  layer {lh.layer:2d}: heads {list(lh.heads)}")
    return 0


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("teacher-forced traces (validation split)")
    group.add_argument("--window", type=int, default=TraceSettings.window, help="tokens per validation window")
    group.add_argument("--steps", type=int, default=TraceSettings.steps, help="verification steps per window")
    group.add_argument("--documents", type=int, default=TraceSettings.documents, help="validation windows")
    group.add_argument("--sources", nargs="+", default=list(TraceSettings.sources), help="corpora, taken in turn")
    group.add_argument("--gamma", type=int, default=TraceSettings.gamma, help="Γ: the ARR window is Γ+1 queries")
    group.add_argument("--max-delta", type=int, default=TraceSettings.max_delta, help="largest target look-back δ")
    group.add_argument("--n-sink", type=int, default=4)
    group.add_argument("--n-recent", type=int, default=16)
    group.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    group.add_argument("--seed", type=int, default=0, help="seed of random-weight presets and of the samplers")


def _trace_settings(args: argparse.Namespace) -> TraceSettings:
    return TraceSettings(window=args.window, steps=args.steps, gamma=args.gamma, max_delta=args.max_delta,
                         documents=args.documents, sources=tuple(args.sources))


def _load_pair(args: argparse.Namespace, device: torch.device) -> tuple[LoadedModel, LoadedModel | None]:
    target = load_model(args.target, device=device, seed=args.seed)
    if target.tokenizer is None:
        raise ConfigError(f"the target {target.source} has no tokenizer; the validation windows need one")
    draft = load_model(args.draft, device=device, seed=args.seed + 1, share_with=target.model) if args.draft else None
    if draft is not None and draft.model.config.vocab_size != target.model.config.vocab_size:
        raise ConfigError(f"draft vocabulary ({draft.model.config.vocab_size}) differs from the target's "
                          f"({target.model.config.vocab_size}); the pair must share a tokenizer")
    return target, draft


def _load_srh(path: Path | None, loaded: LoadedModel, what: str) -> SRHResult:
    if path is None:
        raise ConfigError(f"--{what}-srh is required: profile the {what} first with `trtllm-dustin srh --model "
                          f"{loaded.source} --out {what}_srh.json`")
    srh = SRHResult.load(path)
    if not srh.layers:
        raise ConfigError(f"{path} chose no SRHs (no test counted); re-profile with a lower --min-recall")
    return srh


def _trace(args: argparse.Namespace, target: LoadedModel, target_srh: SRHResult, draft: LoadedModel | None,
           draft_srh: SRHResult | None, cache_path: Path | None) -> tuple[AttentionTrace, float]:
    """Collect the trace (or reuse a cached one made with the same settings and SRHs) -> (trace, seconds)."""
    start = time.perf_counter()
    settings = _trace_settings(args)
    if cache_path is not None and cache_path.is_file():
        trace = AttentionTrace.load(cache_path)
        same = (trace.settings == settings and trace.target_srh == target_srh.layers
                and trace.draft_srh == (draft_srh.layers if draft_srh else ()))
        if same:
            print(f"reusing the attention trace {cache_path}")
            return trace, 0.0
        print(f"{cache_path} was collected with other settings or SRHs; collecting again")
    windows = validation_windows(target.tokenizer, settings)
    trace = collect_trace(target.model, target_srh.layers, windows, settings,
                          draft.model if draft else None, draft_srh.layers if draft_srh else ())
    if cache_path is not None:
        trace.save(cache_path)
    return trace, time.perf_counter() - start


def _policy_table(evaluator: ARREvaluator, budgets: tuple[int, ...], target_layers: list[int],
                  draft_layers: list[int], m: int, m_budget: int, deltas: tuple[int, ...] = (1,)) -> dict:
    """budget -> policy -> mean ARR, for the paper's Fig. 2-3 comparison."""
    table = {}
    for b in budgets:
        if b <= evaluator.protected:
            continue
        row = {"oracle": evaluator.oracle(b), "streaming": evaluator.streaming(b)}
        for delta in deltas:
            row[f"target_history_d{delta}"] = evaluator.target_history(target_layers, b, delta)
        if draft_layers:
            row["draft_lookahead"] = evaluator.draft_lookahead(draft_layers, b)
            row["hybrid"] = evaluator.hybrid(target_layers, draft_layers, b,
                                             scaled_m(m, b, m_budget, evaluator.protected))
        table[str(b)] = {k: round(v, 6) for k, v in row.items()}
    return table


def _plot_table(table: dict, path: Path, title: str) -> None:
    budgets = [int(b) for b in table]
    names = list(next(iter(table.values())))
    plot_arr_vs_budget(budgets, {n: [table[str(b)][n] for b in budgets] for n in names}, path, title)


def add_arr_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model (default: SmolLM2-135M)")
    parser.add_argument("--target-srh", type=Path, default=None, help="the target's SRH JSON (`srh`)")
    parser.add_argument("--draft", default=None, help="draft model (optional: without it, target-side analysis only)")
    parser.add_argument("--draft-srh", type=Path, default=None, help="the draft's SRH JSON")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and PNGs go")
    parser.add_argument("--label", required=True, help="file-name label, e.g. smollm2-135m")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(CURVE_BUDGETS), help="budgets k of the curves")
    parser.add_argument("--budget", type=int, default=512, help="budget of the layer-wise analysis")
    parser.add_argument("--deltas", type=int, nargs="+", default=[1, 2, 4, 8], help="target look-back δ to compare")
    parser.add_argument("--m", type=int, default=None, help="hybrid draft share at --budget (default: half the free)")
    parser.add_argument("--kl-prompts", type=int, default=2, help="prompts of the ARR-KL experiment (0: skip it)")
    parser.add_argument("--kl-prompt-len", type=int, default=2048)
    parser.add_argument("--kl-new-tokens", type=int, default=ARRKLSettings.new_tokens)
    parser.add_argument("--kl-budget", type=int, default=ARRKLSettings.budget)
    parser.add_argument("--note", default="", help="stored in the JSON and plot titles")
    _add_trace_arguments(parser)


def arr_command(args: argparse.Namespace) -> int:
    """ARR of target history (several δ), draft lookahead, hybrid, StreamingLLM and the oracle vs budget; layer-wise
    ARR; the ARR-KL correlation. Writes arr_<label>.json and PNGs into --out-dir."""
    start = time.perf_counter()
    device = _device(args.device)
    provenance = Provenance.capture(device)
    target, draft = _load_pair(args, device)
    target_srh = _load_srh(args.target_srh, target, "target")
    draft_srh = _load_srh(args.draft_srh, draft, "draft") if draft else None
    trace, trace_s = _trace(args, target, target_srh, draft, draft_srh, None)
    evaluator = ARREvaluator(trace, args.n_sink, args.n_recent)
    free = args.budget - evaluator.protected
    m = free // 2 if args.m is None else args.m
    t_layers = evaluator.target_layers
    layer_t = {layer: evaluator.target_history([layer], args.budget) for layer in t_layers}
    best_t = max(layer_t, key=lambda layer: (layer_t[layer], -layer))
    d_layers = evaluator.draft_layers
    layer_d = {d: evaluator.draft_lookahead([d], args.budget) for d in d_layers}
    layer_h = {d: evaluator.hybrid([best_t], [d], args.budget, m) for d in d_layers}
    table = _policy_table(evaluator, tuple(args.budgets), [best_t], list(d_layers), m, args.budget, tuple(args.deltas))
    measured = {policy: evaluator.score_by_layer(policy, args.budget, **kw) for policy, kw in (
        ("oracle", {}), ("streaming", {}), ("target_history", {"target_layers": [best_t]}))}
    label = f"{args.label}{'' if not args.note else ' (' + args.note + ')'}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _plot_table(table, args.out_dir / f"arr_vs_budget_{args.label}.png",
                f"ARR vs budget, {label}: target layer {best_t} SRHs, window {trace.settings.window}, Γ={args.gamma}")
    series = {"T: target history (layer l)": (list(t_layers), [layer_t[x] for x in t_layers],
                                              target.model.config.num_layers)}
    if draft is not None:
        n_d = draft.model.config.num_layers
        series["D: draft lookahead (draft layer l)"] = (list(d_layers), [layer_d[d] for d in d_layers], n_d)
        series[f"H: hybrid (target {best_t} + draft layer l, m={m})"] = (list(d_layers),
                                                                         [layer_h[d] for d in d_layers], n_d)
    plot_layerwise(series, args.out_dir / f"layerwise_{args.label}.png",
                   f"Layer-wise ARR at k={args.budget}, {label}")
    kl_summary: dict = {}
    kl_s = 0.0
    if args.kl_prompts > 0:
        kl_start = time.perf_counter()
        kl_settings = ARRKLSettings(budget=args.kl_budget, n_sink=args.n_sink, n_recent=args.n_recent,
                                    new_tokens=args.kl_new_tokens, seed=args.seed)
        prompt_windows = validation_windows(target.tokenizer, TraceSettings(
            window=args.kl_prompt_len, steps=1, gamma=1, max_delta=1, documents=args.kl_prompts,
            sources=tuple(args.sources)))
        points = arr_kl_points(target.model, [tokens for _, tokens in prompt_windows], kl_settings,
                               target_srh.layers)
        kl_summary = {"settings": asdict(kl_settings), "prompt_len": args.kl_prompt_len,
                      "doc_ids": [doc for doc, _ in prompt_windows], **summarise(points)}
        plot_arr_kl([p.arr_all for p in points], [p.kl for p in points], args.out_dir / f"arr_kl_{args.label}.png",
                    f"ARR vs KL, {label}: Pearson {kl_summary['pearson_arr_all_vs_kl']:.3f} "
                    f"(SRHs {kl_summary['pearson_arr_srh_vs_kl']:.3f}), k={args.kl_budget}")
        kl_s = time.perf_counter() - kl_start
    payload = {
        "note": args.note, "provenance": provenance.finished(time.perf_counter() - start).to_dict(),
        "target": target.source, "draft": draft.source if draft else None,
        "target_srh": str(args.target_srh), "draft_srh": str(args.draft_srh) if draft else None,
        "trace": json.loads(trace.describe()), "n_sink": args.n_sink, "n_recent": args.n_recent,
        "arr_vs_budget": {"target_layer": best_t, "draft_layers": list(d_layers), "m_at_budget": m,
                          "budget_of_m": args.budget, "table": table},
        "layerwise": {"budget": args.budget, "target_history": {str(k): round(v, 6) for k, v in layer_t.items()},
                      "draft_lookahead": {str(k): round(v, 6) for k, v in layer_d.items()},
                      "hybrid_with_best_target_layer": {str(k): round(v, 6) for k, v in layer_h.items()}},
        "arr_per_measured_layer": {"budget": args.budget, "layers": list(t_layers),
                                   **{k: [round(x, 6) for x in v] for k, v in measured.items()}},
        "arr_kl": kl_summary,
        "seconds": {"attention_collection": round(trace_s, 1), "arr_kl": round(kl_s, 1),
                    "total": round(time.perf_counter() - start, 1)},
    }
    out = args.out_dir / f"arr_{args.label}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    _print_table(table)
    print(f"wrote {out} and its plots in {time.perf_counter() - start:.0f} s")
    return 0


def _print_table(table: dict) -> None:
    names = list(next(iter(table.values())))
    print("budget " + " ".join(f"{n[:16]:>16}" for n in names))
    for b, row in table.items():
        print(f"{b:>6} " + " ".join(f"{row[n]:16.4f}" for n in names))


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model (default: SmolLM2-135M)")
    parser.add_argument("--draft", required=True, help="draft model (checkpoint dir, .gguf, or preset:NAME)")
    parser.add_argument("--target-srh", type=Path, default=None, help="the target's SRH JSON (`trtllm-dustin srh`)")
    parser.add_argument("--draft-srh", type=Path, default=None, help="the draft's SRH JSON")
    parser.add_argument("--out", type=Path, required=True, help="Dustin config JSON to write (the runtime reads it)")
    parser.add_argument("--record", type=Path, default=None, help="search record JSON (default: <out>.record.json)")
    parser.add_argument("--budget", type=int, default=SearchSettings.budget, help="deployment budget k")
    parser.add_argument("--search-budgets", type=int, nargs="+", default=list(SearchSettings.search_budgets))
    parser.add_argument("--phase2-share", type=float, default=SearchSettings.phase2_draft_share,
                        help="draft share of the free budget while phase 2 compares draft layers")
    parser.add_argument("--max-draft-layers", type=int, default=SearchSettings.max_draft_layers)
    parser.add_argument("--trials", type=int, default=SearchSettings.trials, help="Optuna trials over m")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the attention trace (<out>.trace.pt, ~100s of MB) and the Optuna study "
                             "(<out>.optuna.sqlite3) are kept (default: beside --out)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the trace if it matches and continue the Optuna study in --work-dir")
    parser.add_argument("--plots", type=Path, default=None, help="also write ARR-vs-budget and layer-wise PNGs here")
    parser.add_argument("--note", default="", help="stored in the record (e.g. 'random draft: ARR meaningless')")
    _add_trace_arguments(parser)


def search_command(args: argparse.Namespace) -> int:
    """Algorithm 1 for a target-draft pair: writes the Dustin config (--out) and the search record."""
    start = time.perf_counter()
    device = _device(args.device)
    provenance = Provenance.capture(device)
    stem = args.out.with_suffix("")
    work = args.work_dir or args.out.parent
    work.mkdir(parents=True, exist_ok=True)
    study = work / f"{args.out.stem}.optuna.sqlite3"
    trace_cache = work / f"{args.out.stem}.trace.pt"
    if not args.resume:
        study.unlink(missing_ok=True)
    settings = SearchSettings(budget=args.budget, search_budgets=tuple(args.search_budgets),
                              phase2_draft_share=args.phase2_share, max_draft_layers=args.max_draft_layers,
                              trials=args.trials, seed=args.seed, n_sink=args.n_sink, n_recent=args.n_recent,
                              gamma=args.gamma, study_path=str(study))
    target, draft = _load_pair(args, device)
    target_srh = _load_srh(args.target_srh, target, "target")
    draft_srh = _load_srh(args.draft_srh, draft, "draft")
    trace, trace_s = _trace(args, target, target_srh, draft, draft_srh, trace_cache if args.resume else None)
    if not args.resume:
        trace.save(trace_cache)
    evaluator = ARREvaluator(trace, args.n_sink, args.n_recent)
    outcome = run_search(evaluator, settings)
    config = dustin_config(outcome, settings, target_srh.layers, draft_srh.layers, target.model.config,
                           draft.model.config)
    config.check_models(target.model.config, draft.model.config)
    budgets = tuple(sorted({*CURVE_BUDGETS, *settings.search_budgets, settings.budget}))
    table = _policy_table(evaluator, budgets, [outcome.target_layer], list(outcome.draft_layers), outcome.m,
                          settings.budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config.save(args.out)
    seconds = {"attention_collection": round(trace_s, 1), **outcome.seconds,
               "total": round(time.perf_counter() - start, 1)}
    record = SearchRecord(settings, outcome, config, table, {
        "target": target.source, "draft": draft.source, "target_srh": str(args.target_srh),
        "draft_srh": str(args.draft_srh), "target_srh_provenance": target_srh.provenance,
        "draft_srh_provenance": draft_srh.provenance, "trace": json.loads(trace.describe())}, seconds, args.note,
        provenance.finished(time.perf_counter() - start).to_dict())
    record_path = args.record or Path(f"{stem}.record.json")
    record.save(record_path)
    if args.plots is not None:
        name = args.out.stem
        title = f"{target.model.config.name} + {draft.model.config.name}{' (' + args.note + ')' if args.note else ''}"
        _plot_table(table, args.plots / f"{name}_arr_vs_budget.png", f"ARR vs budget: {title}")
        t_layers, d_layers = evaluator.target_layers, evaluator.draft_layers
        plot_layerwise({
            "T: target history (layer l)": (list(t_layers), [outcome.phase1[x] for x in t_layers],
                                            target.model.config.num_layers),
            "H: hybrid, phase 2 round 1 (draft layer l)": (list(d_layers), [outcome.phase2[0][d] for d in d_layers],
                                                          draft.model.config.num_layers),
            "D: draft lookahead (draft layer l)": (list(d_layers), [
                sum(evaluator.draft_lookahead([d], b) for b in settings.search_budgets) / len(settings.search_budgets)
                for d in d_layers], draft.model.config.num_layers)},
            args.plots / f"{name}_layerwise.png", f"Layer-wise ARR (mean over k in {list(settings.search_budgets)}): "
                                                  f"{title}")
    _print_table(table)
    print(f"target layer {outcome.target_layer}, draft layers {list(outcome.draft_layers)}, m = {outcome.m} at "
          f"k = {settings.budget}: hybrid ARR {outcome.arr:.4f}")
    print(f"wrote {args.out} and {record_path}; phases {outcome.seconds} s, total {seconds['total']:.0f} s")
    return 0


def add_layers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target model (default: SmolLM2-135M)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the pair's Dustin config to extend (default: the packaged pair's); its k is kept")
    parser.add_argument("--out", type=Path, default=None, help="Dustin config JSON to write (with selection_layers)")
    parser.add_argument("--record", type=Path, default=None, help="search record JSON (default: <out>.layers.json)")
    parser.add_argument("--srh", type=Path, default=None,
                        help="the target's SRH JSON (`trtllm-dustin srh`): candidates also score on each layer's "
                        "retrieval heads (default: every head only)")
    parser.add_argument("--needle-windows", type=int, default=12,
                        help="needle-in-a-haystack windows of the objective's needle recall, 0: none")
    parser.add_argument("--save-windows", type=Path, default=None,
                        help="write the token windows (text and needles, from the corpora) to this .npz and exit: a "
                        "machine without the corpora then searches with --windows")
    parser.add_argument("--windows", type=Path, default=None, help="the windows from --save-windows")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(InPassSettings.budgets),
                        help="k of the objective's mean")
    parser.add_argument("--lag", type=int, default=InPassSettings.lag,
                        help="steps between a round's choice and the next round's pre-pass")
    parser.add_argument("--max-layers", type=int, default=InPassSettings.max_layers,
                        help="selection layers at most")
    parser.add_argument("--earlier-selection", action="store_true",
                        help="phase B also tries layers below the first selection layer (each chooses a fresh set for "
                        "the layers up to the next selection layer)")
    parser.add_argument("--min-gain", type=float, default=InPassSettings.min_gain,
                        help="objective a re-selection or pooled layer must add")
    parser.add_argument("--max-pool", type=int, default=InPassSettings.max_pool,
                        help="pooled layers (phase C: scored below the first selection layer, summed into its choice) "
                        "at most, 0: no pooling")
    parser.add_argument("--score-windows", nargs="*", default=[], metavar="WIDTHop",
                        help="phase D's score windows, say 3max 7max 5mean (odd width >= 3, then max or mean: each "
                        "position's score becomes the max or mean over that many neighbours before the top-k); the "
                        "best is kept if it adds --min-gain (default: none, phase D skipped)")
    parser.add_argument("--split", default="train", choices=("train", "validation"),
                        help="the corpora split the windows come from")
    _add_trace_arguments(parser)


def _needle_windows(tokenizer, window: int, count: int, split: str
                    ) -> tuple[list[list[int]], list[tuple[int, int]], int]:
    """`count` needle prompts teacher-forced through their needle: each window is a prompt of window - A tokens with a
    needle of NEEDLES at an evenly spread depth, then the needle's first A tokens (A: the shortest needle)."""
    from trtllm_dustin.search.needle_haystack import NEEDLES, build_prompt, haystack_tokens

    answers = [list(tokenizer.encode(" " + n.text, add_special_tokens=False)) for n in NEEDLES]
    answer_len = min(len(a) for a in answers)
    haystack = haystack_tokens(tokenizer, window, split=split)
    tokens, spans = [], []
    for i in range(count):
        prompt = build_prompt(tokenizer, haystack, NEEDLES[i % len(NEEDLES)], window - answer_len,
                              (i + 0.5) / count)
        tokens.append(list(prompt.tokens) + answers[i % len(NEEDLES)][:answer_len])
        spans.append(prompt.needle_span)
    return tokens, spans, answer_len


def _score_window(text: str) -> tuple[int, str]:
    """'7max' -> (7, 'max'); InPassSettings checks the width and the op."""
    width = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    if not width.isdigit():
        raise ConfigError(f"--score-windows {text!r}: write an odd width and then max or mean, say 5max")
    return int(width), text[len(width):]


def layers_command(args: argparse.Namespace) -> int:
    """The in-pass selection layers of a target (search/in_pass.py): writes the config with selection_layers."""
    import numpy as np

    from trtllm_dustin.models.loading import default_dustin_config_path

    start = time.perf_counter()
    if args.out is None and args.save_windows is None:
        raise ConfigError("search-layers needs --out (the config to write) or --save-windows (the windows to save)")
    device = _device(args.device)
    provenance = Provenance.capture(device)
    base = DustinConfig.load(args.config or default_dustin_config_path())
    settings = InPassSettings(budgets=tuple(args.budgets), lag=args.lag, max_layers=args.max_layers,
                              min_gain=args.min_gain, max_pool=args.max_pool, n_sink=base.n_sink,
                              n_recent=base.n_recent, earlier=args.earlier_selection,
                              windows=tuple(_score_window(text) for text in args.score_windows))
    text_settings = _trace_settings(args)
    srh = SRHResult.load(args.srh) if args.srh else None
    target = load_model(args.target, device=device, seed=args.seed)
    base.check_models(target.model.config, None)
    if args.windows is None:
        if target.tokenizer is None:
            raise ConfigError(f"the target {target.source} has no tokenizer; the windows need one")
        text = validation_windows(target.tokenizer, text_settings, split=args.split)
        needles = (_needle_windows(target.tokenizer, args.window, args.needle_windows, args.split)
                   if args.needle_windows
                   else ([], [], 0))
        if args.save_windows is not None:
            np.savez_compressed(args.save_windows, text=np.asarray([t for _, t in text], dtype=np.int32),
                                text_ids=np.asarray([d for d, _ in text]),
                                needles=np.asarray(needles[0], dtype=np.int32).reshape(len(needles[0]), args.window),
                                needle_spans=np.asarray(needles[1], dtype=np.int64).reshape(-1, 2),
                                answer_len=np.asarray(needles[2]), split=np.asarray(args.split))
            print(f"wrote {args.save_windows}: {len(text)} text and {len(needles[0])} needle windows of {args.window}")
            return 0
    else:
        data = np.load(args.windows)
        text = [(str(d), t.tolist()) for d, t in zip(data["text_ids"], data["text"], strict=True)]
        needles = ([t.tolist() for t in data["needles"]], [tuple(x) for x in data["needle_spans"].tolist()],
                   int(data["answer_len"]))
        if str(data["split"]) != args.split:
            raise ConfigError(f"--windows {args.windows} holds the {data['split']} split, not --split {args.split}")
    config = target.model.config
    every = tuple(LayerHeads(layer, tuple(range(config.num_heads))) for layer in range(config.num_layers))
    srh_heads = {lh.layer: lh.heads for lh in srh.layers} if srh else {}
    if srh and sorted(srh_heads) != list(range(config.num_layers)):
        raise ConfigError(f"{args.srh} lists SRH heads for layers {sorted(srh_heads)}; the search needs every layer")
    srh_layers = tuple(LayerHeads(layer, srh_heads[layer]) for layer in range(config.num_layers)) if srh else ()

    def traces(windows: list[tuple[str, list[int]]], trace_settings: TraceSettings,
               spans: torch.Tensor | None = None) -> SearchTraces:
        every_trace = collect_trace(target.model, every, windows, trace_settings)
        srh_trace = collect_trace(target.model, srh_layers, windows, trace_settings) if srh else None
        return SearchTraces(every_trace, srh_trace, spans)

    text_traces = traces(text, text_settings)
    needle_traces = None
    if needles[0]:
        # the steps whose Γ + 1 verified queries all lie in the teacher-forced answer (the last answer_len tokens)
        steps = needles[2] - args.gamma
        if steps <= settings.lag:
            raise ConfigError(f"the needles' answers hold {needles[2]} tokens: too few for Γ = {args.gamma} and the "
                              f"lag {settings.lag}")
        needle_settings = replace(text_settings, steps=min(steps, text_settings.steps), documents=len(needles[0]))
        needle_traces = traces([(f"needle/{i}", t) for i, t in enumerate(needles[0])], needle_settings,
                               torch.tensor(needles[1], dtype=torch.int64))
    trace_s = time.perf_counter() - start
    objective = InPassObjective(text_traces, settings, needle_traces)
    outcome = search_selection_layers(objective)
    def heads(layer: int, kind: str) -> LayerHeads:
        return LayerHeads(layer, tuple(range(config.num_heads)) if kind == "all" else srh_heads[layer])

    chosen = replace(base, selection_layers=tuple(heads(*c) for c in outcome.layers),
                     pool_layers=tuple(heads(*c) for c in outcome.pool), score_window=outcome.window[0],
                     score_window_op=outcome.window[1])
    chosen.check_models(target.model.config, None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    chosen.save(args.out)
    record = {"settings": asdict(settings), "split": args.split, "srh": str(args.srh) if args.srh else None,
              "text_trace": json.loads(text_traces.every_head.describe()),
              "needle_trace": json.loads(needle_traces.every_head.describe()) if needle_traces else None,
              "needle_spans": needles[1], "outcome": outcome.to_dict(),
              "per_layer_text_arr": {b: objective.per_layer(outcome.layers, b, pool=outcome.pool,
                                                            window=outcome.window) for b in settings.budgets},
              "seconds": {"traces": round(trace_s, 1), "total": round(time.perf_counter() - start, 1)},
              "provenance": provenance.finished(time.perf_counter() - start).to_dict()}
    record_path = args.record or args.out.with_suffix(".layers.json")
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    best = sorted(outcome.phase_a.items(), key=lambda kv: -kv[1])[:6]
    print("phase A (objective alone): " + ", ".join(f"layer {c[0]} {c[1]} {v:.4f}" for c, v in best))
    print(f"selection layers {[f'{layer} ({kind})' for layer, kind in outcome.layers]}, pooled "
          f"{[f'{layer} ({kind})' for layer, kind in outcome.pool]}: objective {outcome.value:.4f}; "
          + ", ".join(f"k={b}: text ARR {v['text_arr']:.4f}, needle recall {v['needle_recall']:.4f}"
                      for b, v in outcome.by_budget.items()))
    if outcome.phase_d:
        print("phase D (score window): " + ", ".join(f"{'none' if w[0] == 1 else f'{w[0]}{w[1]}'} {v:.4f}"
                                                     for w, v in dict(outcome.phase_d).items())
              + f"; kept {'none' if outcome.window[0] == 1 else f'{outcome.window[0]}{outcome.window[1]}'}")
    print(f"wrote {args.out} and {record_path} in {time.perf_counter() - start:.0f} s")
    return 0


# name, its arguments, what it runs, its --help line: the four commands of this module and of `trtllm-dustin`
COMMANDS = (
    ("srh", add_srh_arguments, srh_command, "identify semantic retrieval heads (needle-in-a-haystack profiling)"),
    ("arr", add_arr_arguments, arr_command, "ARR analysis: policies vs budget, layer-wise ARR, ARR-KL correlation"),
    ("search", add_search_arguments, search_command, "Algorithm 1: write the Dustin config of a target-draft pair"),
    ("search-layers", add_layers_arguments, layers_command,
     "the in-pass selection layers of a target (written into its Dustin config)"),
)


def add_commands(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    for name, add_arguments, command, text in COMMANDS:
        command_parser = sub.add_parser(name, help=text, formatter_class=formatter)
        add_arguments(command_parser)
        command_parser.set_defaults(func=command)


def build_parser() -> argparse.ArgumentParser:
    """The four commands, --help showing every default as `trtllm-dustin srh|arr|search|search-layers` do."""
    from trtllm_dustin.cli import DefaultsHelp

    parser = argparse.ArgumentParser(prog="python -m trtllm_dustin.search.cli", description=__doc__)
    add_commands(parser.add_subparsers(dest="command", required=True), DefaultsHelp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ConfigError, ModelLoadError) as e:
        print(f"trtllm-dustin: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
