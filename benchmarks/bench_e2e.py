"""End-to-end decoding speed of every method at the paper's model shapes, side by side in one process.

Random weights of the real shapes (a step costs the same whatever the values). Every method, vanilla included,
runs the runtime's own round (Decoder.round) from its registry entry. Random weights accept nothing useful, so
speculative rounds commit accepted counts drawn from a stated distribution (stated_acceptance.py: a truncated
geometric with per-token acceptance alpha, solved so that E[accepted + 1] = tau; the paper's tau per method: for
Llama-3.1-8B + 1B Dustin 2.8, Classic SD 2.7, MagicDec 2.6 (Table 10, batch 16, 32K), 2.2 for Qwen) while every
kernel runs for real: these rows are labelled "stated tau", and their tokens/s is
B * tau / round time at the stated tau (what the timed rounds actually committed is kept beside it as
tokens_per_s_realized). Per (pair, batch) one cache is sized for the longest context that fits and contexts are
swept by setting the committed lengths, so every method captures its CUDA graphs once, as a server with a static
cache would. Each method runs a throughput pass (no events) and a profiling pass (CUDA events per phase).
Vanilla's distance from its floor, (weights + KV bytes) / 4.26 TB/s, is printed.

The LongSpark rows (longspark, dustin-t-longspark, dustin-h-longspark) run a random LongSpark drafter sized like
the paper's (five blocks on target layers spread over the depth, one of them the Dustin config's target SRH layer,
W = 256, R = 16, a block of 7 slots proposing Γ). Their stated tau is the pair's tau times a measured ratio
(--tau-ratios, from the real pair: LongSpark's tau over the autoregressive draft's), labelled so. The ring rows
(method "ring", evaluation only) run a random ring drafter: --ring-layers own layers of the target's shape, reading
the same five layers' hidden states, a ring of 256 rows; their stated tau takes a ratio the same way.

A speculative method named with the suffix "+fp8kv" (e.g. dustin-h+fp8kv) runs with the draft's KV cache in fp8
(e4m3, `trtllm_dustin.plugins.kv_dtype`): half the draft's cache reads; the target's cache stays bf16.

--budget K1,K2,... runs every sparse method at each Dustin budget k (the quality-speed frontier, plot_frontier.py); the
headline rows at the real pair's measured tau are computed from these round times by measured_tau.py.

    python benchmarks/bench_e2e.py --pair llama-8b --batches 8,16 --contexts 8192,16384,24576,32768,65536
    python benchmarks/bench_e2e.py --pair llama-8b --batches 16 --contexts 32768 --budget 512,1024,2048,4096 \
        --methods vanilla,classic,dustin-h,dustin-h-sparse-draft
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from common import RESULTS, Clock, copy_bandwidth, environment, save_json
from stated_acceptance import StatedAcceptor, stated_acceptance

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache, available_memory
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import random_longspark, spread_layers
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS, quantize_draft
from trtllm_dustin.models.ring_drafter import RingDrafterConfig, random_ring_drafter
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.kv_dtype import FP8_KV_DTYPE, to_cache_dtype
from trtllm_dustin.plugins.pdl import pdl_supported
from trtllm_dustin.runtime.build import attention_backend, build_runtime
from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress

# Kernel paths that can be turned off for A/B runs: flag -> (KernelConfig field, help).
SWITCHES = {
    "fused-elementwise": ("fused_elementwise", "run the models' elementwise work as fused kernels "
                          "(plugins/fused_ops.py)"),
    "pdl": ("pdl", "programmatic dependent launch for the Triton kernels (plugins/pdl.py; sm_90+ only)"),
    "skinny-linear": ("skinny_linear", "decode-sized projections on the Triton skinny-M GEMM "
                      "(plugins/skinny_linear.py) instead of cuBLAS; fused path only"),
    "skinny-pdl": ("skinny_pdl", "launch the skinny-M GEMM with programmatic dependent launch (sm_90+)"),
    "skinny-ties": ("skinny_ties", "PDL launches of the skinny GEMM also take the shapes where it tied with cuBLAS"),
    "round-kernels": ("round_kernels", "greedy argmax and the round commit as Triton kernels "
                      "(plugins/argmax.py, commit.py) instead of torch ops"),
    "int8-wide": ("int8_wide", "int8 drafter projections of more than 64 rows (the ring drafter's observe pass at "
                  "B = 16) on cuBLAS with a dequantized copy of the weight (models/quantize.py)"),
}


def add_kernel_switches(parser: argparse.ArgumentParser) -> None:
    """--FLAG off|on for each switch of SWITCHES (the benches' A/B runs), each defaulting to KernelConfig's default
    (None counts as on); kernel_config(args) reads them back."""
    defaults = KernelConfig()
    for flag, (name, about) in SWITCHES.items():
        default = "off" if getattr(defaults, name) is False else "on"
        parser.add_argument(f"--{flag}", choices=["off", "on"], default=default, help=f"{about} (default: {default})")


def kernel_config(args: argparse.Namespace) -> KernelConfig:
    """The run's kernel paths from add_kernel_switches' flags: one frozen config for every decoder."""
    return KernelConfig(**{field: getattr(args, flag.replace("-", "_")) == "on"
                           for flag, (field, _) in SWITCHES.items()})


def bench_ring_drafter(target, reads, own_layers: int, head_ids: int = 0, weights: str = "model",
                       wide: bool = False):
    """The benches' random ring drafter at the real shapes: `own_layers` of the target's shape spread over its
    depth, reading the layers `reads`, a ring of 256 rows, a block of 7; with a subset head of `head_ids` ids (the
    first ones: which ids does not change the cost), or the whole vocabulary (0); its layers and head as `weights`
    (RingDrafter.quantize_weights; `wide`: KernelConfig.int8_wide)."""
    model = random_ring_drafter(target, RingDrafterConfig(reads, spread_layers(target.config.num_layers, own_layers),
                                                          256, 7), seed=3)
    return model.use_head(torch.arange(head_ids) if head_ids else None).quantize_weights(weights, wide)


FP8_DRAFT = "+fp8kv"  # method-name suffix: the draft's KV cache in fp8
DEFAULT_METHODS = ("vanilla", "classic", "magicdec", "dustin-h", "dustin-h-sparse-draft", "dustin-ip",
                   "dustin-ip-sparse-draft", "classic" + FP8_DRAFT, "dustin-h" + FP8_DRAFT, "dustin-ip" + FP8_DRAFT,
                   "longspark", "dustin-t-longspark")


def split_method(method: str) -> tuple[str, bool]:
    """'dustin-h+fp8kv' -> ('dustin-h', True): the registered method and whether its draft cache is fp8."""
    base = method.removesuffix(FP8_DRAFT)
    if base not in METHODS:
        raise SystemExit(f"--methods: {base!r} is not a registered method; choose from {', '.join(METHODS)} (a "
                         f"speculative one may carry {FP8_DRAFT})")
    if base != method and not METHODS[base].needs_draft:
        raise SystemExit(f"--methods: {method} has no draft; {FP8_DRAFT} applies to speculative methods only")
    return base, base != method


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str
    gamma: int
    tau: float  # the paper's mean accepted length for this family (Dustin's)
    dustin: DustinConfig  # paper-sized estimator: 1 target layer x 4 heads, 3 draft layers x 4 heads
    method_tau: dict[str, float] = field(default_factory=dict)  # the paper's own tau of a baseline, where it differs

    def stated_tau(self, method: str) -> float:
        """The stated tau of a registered method (its +fp8kv twin takes the same): the paper's per-method value."""
        return self.method_tau.get(method, self.tau)


def _paper_sized(target_layer: int, target_heads: tuple[int, ...], draft_layers: tuple[int, ...],
                 draft_heads: tuple[int, ...], num_layers: int) -> DustinConfig:
    # Hand-written placeholders, not searched: they fix the estimator's cost, not its quality. The in-pass selection
    # layers (and the pooled layers below the first) sit at the depths the search chose for the real pair (the
    # packaged SmolLM2 config, `search-layers`), each scoring on 4 heads of 4 KV groups, as the searched config does
    # on its layers' 4 SRH heads, with the packaged score window.
    at = sorted({min(num_layers - 1, round(d * num_layers)) for d in _SELECTION_DEPTHS})
    below = sorted({round(d * num_layers) for d in _POOL_DEPTHS} - set(at))
    return DustinConfig(target_layers=(LayerHeads(target_layer, target_heads),),
                        draft_layers=tuple(LayerHeads(layer, draft_heads) for layer in draft_layers), budget=512,
                        m=128, selection_layers=tuple(LayerHeads(layer, target_heads) for layer in at),
                        pool_layers=tuple(LayerHeads(layer, target_heads) for layer in below if layer < at[0]),
                        score_window=_SCORE_WINDOW[0], score_window_op=_SCORE_WINDOW[1])


def _packaged_in_pass() -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, str]]:
    """The depths (layer / layer count) of the packaged config's selection and pooled layers, and its score window."""
    from trtllm_dustin.models.packaged import default_dustin_config_path

    config = DustinConfig.load(default_dustin_config_path())
    n = 30  # the layer count of SmolLM2-135M, the model the packaged config was searched on
    return (tuple(lh.layer / n for lh in config.selection_layers), tuple(lh.layer / n for lh in config.pool_layers),
            (config.score_window, config.score_window_op))


_SELECTION_DEPTHS, _POOL_DEPTHS, _SCORE_WINDOW = _packaged_in_pass()


PAIRS = {
    # Table 10 of the paper (Llama-3.1-8B + 1B, batch 16, 32K): Classic SD 2.7, MagicDec 2.6, Dustin 2.8
    "llama-8b": Pair("preset:llama-3.1-8b", "preset:llama-3.2-1b", 3, 2.8,
                     _paper_sized(16, (0, 8, 16, 24), (4, 8, 12), (0, 8, 16, 24), 32),
                     method_tau={"classic": 2.7, "magicdec": 2.6}),
    "qwen-7b": Pair("preset:qwen2.5-7b", "preset:qwen2.5-0.5b", 3, 2.2,
                    _paper_sized(14, (0, 7, 14, 21), (6, 12, 18), (0, 3, 7, 10), 28)),
    "qwen-14b": Pair("preset:qwen2.5-14b", "preset:qwen2.5-0.5b", 3, 2.2,
                     _paper_sized(24, (0, 10, 20, 30), (6, 12, 18), (0, 3, 7, 10), 48)),
    # The 70B-class pairs of the pipeline runs (--pp 4; one H200 cannot hold them): the family's stated tau, as the
    # paper has no 70B-class row in Tables 10-11.
    "llama-70b": Pair("preset:llama-3.3-70b", "preset:llama-3.2-1b", 3, 2.8,
                      _paper_sized(40, (0, 16, 32, 48), (4, 8, 12), (0, 8, 16, 24), 80),
                      method_tau={"classic": 2.7, "magicdec": 2.6}),
    "qwen-72b": Pair("preset:qwen2.5-72b", "preset:qwen2.5-0.5b", 3, 2.2,
                     _paper_sized(40, (0, 16, 32, 48), (6, 12, 18), (0, 3, 7, 10), 80)),
    "tiny": Pair("preset:tiny-llama", "preset:tiny-llama-draft", 3, 2.8,  # CPU smoke test of this script
                 DustinConfig(target_layers=(LayerHeads(1, (0, 3)),), draft_layers=(LayerHeads(1, (0, 2)),),
                              budget=48, m=8, n_recent=8, selection_layers=(LayerHeads(1, tuple(range(6))),))),
}


def fitting_context(target, draft, batch: int, contexts: list[int], margin: int, device: torch.device,
                    dtype: torch.dtype, fp8_draft: bool = False) -> int | None:
    """The longest context whose caches (and the fp8 draft cache, if asked for) fit next to the loaded weights
    (with room for activations)."""
    per_token = (target.config.kv_bytes_per_token(2) + draft.config.kv_bytes_per_token(2)
                 + (draft.config.kv_bytes_per_token(1) if fp8_draft else 0)) * batch
    free = available_memory(device) - (6 << 30 if device.type == "cuda" else 1 << 30)
    fits = [c for c in contexts if per_token * (c + margin) <= free]
    return max(fits) if fits else None


def longspark_layers(num_layers: int, srh_layer: int) -> tuple[int, ...]:
    """Five target layers spread over the depth, the one nearest the SRH layer replaced by it (Dustin's hybrid scores
    the LongSpark block that reads the SRH layer)."""
    layers = list(spread_layers(num_layers, 5))
    nearest = min(range(len(layers)), key=lambda i: abs(layers[i] - srh_layer))
    layers[nearest] = srh_layer
    return tuple(sorted(set(layers)))


def start_at(decoder: Decoder, batch: int, context: int, tokens: torch.Tensor, width: int) -> Progress:
    """Every slot as if a `context`-token prompt had just been prefilled (the caches hold random K/V instead): the
    slots' lengths, the drafter's and selector's prompt-time hooks, and a fresh run of up to `width` tokens."""
    prompts = [[int(t)] * context for t in tokens.tolist()]
    config, dtype = decoder.target.config, decoder.target.embed.weight.dtype
    queries = {layer: torch.zeros(batch, config.num_heads, config.head_dim, dtype=dtype, device=tokens.device)
               for layer in decoder.target_query_layers}
    hidden = {layer: torch.randn(batch, config.hidden_size, dtype=dtype, device=tokens.device)
              for layer in decoder.target_hidden_layers}
    window = {layer: torch.randn(batch, decoder.drafter.window_rows, config.hidden_size, dtype=dtype,
                                 device=tokens.device) for layer in decoder.drafter.window_layers}
    decoder.prefilled(slice(0, batch), prompts, queries, hidden, window)
    progress = Progress.allocate(batch, width, decoder.gamma, (), tokens.device)
    decoder.begin(progress, slice(0, batch), tokens, prompts, width)
    return progress


def bench_batch(pair: Pair, target, draft, batch: int, contexts: list[int], args, device, dtype) -> list[dict]:
    rounds, gamma = args.rounds, pair.gamma
    margin = (3 * rounds + 8) * (gamma + 1) + 64
    fp8_draft = any(split_method(m)[1] for m in args.methods)
    longest = fitting_context(target, draft, batch, contexts, margin, device, dtype, fp8_draft)
    rows = [{"batch": batch, "context": c, "skipped": "KV caches do not fit in device memory"}
            for c in contexts if longest is None or c > longest]
    if longest is None:
        return rows
    S = longest + margin
    tcache = KVCache.allocate(target.config, batch, S, dtype, device)
    dcache = KVCache.allocate(draft.config, batch, S, dtype, device)
    for t in (tcache.k, tcache.v, dcache.k, dcache.v):
        t.normal_()
    dcache8 = KVCache.allocate(draft.config, batch, S, FP8_KV_DTYPE, device) if fp8_draft else None
    if dcache8 is not None:
        for layer in range(draft.config.num_layers):  # the same values, stored as the fp8 cache stores them
            dcache8.k[layer].copy_(to_cache_dtype(dcache.k[layer], FP8_KV_DTYPE))
            dcache8.v[layer].copy_(to_cache_dtype(dcache.v[layer], FP8_KV_DTYPE))
    probs, alpha = stated_acceptance(args.tau or pair.tau, gamma)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    bandwidth = copy_bandwidth()  # None off the H200: vanilla's floor is left out rather than another card's
    clock = Clock(device)
    kernels = args.kernels
    backend = attention_backend(device, kernels)
    sampling = SlotSampling.batch(SamplingParams(), batch, device)
    spark = ring = None
    layers = longspark_layers(target.config.num_layers, pair.dustin.target_layers[0].layer)
    if any(METHODS[split_method(m)[0]].needs_longspark for m in args.methods):
        spark = random_longspark(target, seed=2, target_layers=layers)
    if any(METHODS[split_method(m)[0]].needs_ring for m in args.methods):
        ring = bench_ring_drafter(target, layers, args.ring_layers, args.ring_head_ids, args.ring_weights,
                                  kernels.int8_wide)
    runs = [(method, budget) for method in args.methods
            for budget in (args.budgets if METHODS[split_method(method)[0]].sparse else [None])]
    for method, budget in runs:
        base, fp8 = split_method(method)
        dustin = pair.dustin.with_budget(budget) if budget is not None else pair.dustin
        decoder = build_runtime(base, target, draft=draft, longspark=spark, ring=ring, dustin=dustin,
                                target_cache=tcache,
                                draft_cache=dcache8 if fp8 else dcache, kernels=kernels, backend=backend, gamma=gamma,
                                use_cuda_graph=device.type == "cuda")
        ratio = args.tau_ratios.get(method, 1.0)
        tau = (args.tau or pair.stated_tau(base)) * ratio if decoder.gamma else 1.0
        probs, alpha = stated_acceptance(tau, gamma) if decoder.gamma else (probs, alpha)
        acceptor = StatedAcceptor(probs.to(device), use_kernel=kernels.round_kernels) if decoder.gamma else None
        for context in [c for c in contexts if c <= longest]:
            row = {"batch": batch, "context": context, "method": method, "budget": budget}
            # Ids both models embed: Qwen2.5-7B's vocabulary (152064) is larger than the 0.5B draft's (151936), and
            # an id past the draft's table trips the draft embedding's device-side assert (seen on the H200).
            tokens = torch.randint(0, min(target.config.vocab_size, draft.config.vocab_size), (batch,), device=device)
            passes = {}
            for profile in (False, True):
                progress = start_at(decoder, batch, context, tokens, margin)
                for _ in range(2):  # warm-up (JIT, graph capture on first use)
                    decoder.round(progress, sampling, acceptor)
                before = int(progress.generated.sum())
                timer = PhaseTimer(profile, device)
                total = clock(lambda d=decoder, pr=progress, ac=acceptor, tm=timer: [
                    d.round(pr, sampling, ac, tm) for _ in range(rounds)])
                passes[profile] = (total, int(progress.generated.sum()) - before, timer.totals_ms())
            total, committed, _ = passes[False]
            ms = total / rounds
            # Throughput at the stated tau: a round's work has fixed shapes whatever it accepts, so this is
            # B * tau per round time; the realized draws (a few hundred) scatter around tau by a few percent,
            # which would otherwise move the speedup by as much. What the timed rounds committed is kept too.
            row.update(ms_per_round=ms, tokens_per_s=batch * tau / ms * 1e3, tokens_per_s_realized=committed / total
                       * 1e3, tau_realized=committed / (batch * rounds),
                       phase_ms_per_round={k: v / rounds for k, v in passes[True][2].items()})
            if decoder.gamma:
                label = "stated tau (random weights)" if method not in args.tau_ratios else \
                    f"stated tau x measured ratio {ratio:.3f} (random weights)"
                row.update(tau_stated=tau, alpha=alpha, acceptance=label)
                if METHODS[base].needs_longspark or METHODS[base].needs_ring:
                    row["drafter_state_bytes"] = decoder.drafter.state_bytes()
            else:
                floor = (weight_bytes + target.config.kv_bytes_per_token(2) * batch * (context + 1)) / bandwidth \
                    if bandwidth else None
                row.update(floor_ms=floor and floor * 1e3, fraction_of_floor=floor and floor * 1e3 / ms)
            if args.profile_kernels and device.type == "cuda" and context == max(c for c in contexts if c <= longest):
                one = partial(decoder.round, progress, sampling, acceptor)
                try:  # a profiler failure costs the profile, not the measured row
                    row["kernel_profile"] = kernel_profile(one, rounds)
                except RuntimeError as error:
                    row["kernel_profile_error"] = str(error)[:300]
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "kernel_profile"},
                  flush=True)
        del decoder
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del tcache, dcache, dcache8
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def kernel_profile(call, repeats: int, top: int = 40) -> dict:
    """GPU time per call of each kernel `call` launches (torch.profiler, CUDA activity; graph replays included):
    the `top` kernels by time, their launch counts per call, and the sum over all kernels against the wall time."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    busy_us = sum(e.device_time_total for e in kernels) / repeats
    return {"repeats": repeats, "wall_ms_per_call": start.elapsed_time(end) / repeats,
            "kernel_ms_per_call": busy_us / 1e3, "launches_per_call": sum(e.count for e in kernels) / repeats,
            "top": [{"name": e.key[:120], "launches_per_call": e.count / repeats,
                     "ms_per_call": e.device_time_total / repeats / 1e3} for e in kernels[:top]]}


def add_speedups(rows: list[dict]) -> None:
    vanilla = {(r["batch"], r["context"]): r["tokens_per_s"] for r in rows if r.get("method") == "vanilla"}
    for r in rows:
        if "tokens_per_s" in r and (r["batch"], r["context"]) in vanilla:
            r["speedup_vs_vanilla"] = r["tokens_per_s"] / vanilla[(r["batch"], r["context"])]


def engine_models(args: argparse.Namespace, pair: Pair, device: torch.device, dtype: torch.dtype, max_pos: int):
    """--engine: the target and draft from the engine (checked first), the kernel config with its tactic table."""
    from dataclasses import replace

    from trtllm_dustin.build_engines.engine import open_engine

    start = time.perf_counter()
    engine = open_engine(args.engine, device=device)
    checked = time.perf_counter() - start
    names = {"target": engine.target.config.name, "draft": engine.draft.config.name if engine.draft else None}
    want = {"target": pair.target.removeprefix("preset:"), "draft": pair.draft.removeprefix("preset:")}
    if names != want or engine.manifest.limits.dtype != str(dtype).removeprefix("torch."):
        raise SystemExit(f"--engine {args.engine} holds {names} in {engine.manifest.limits.dtype}; the pair "
                         f"{args.pair} needs {want} in {dtype}: build it with `trtllm-dustin build --model "
                         f"{pair.target} --draft {pair.draft}`")
    target = engine.target.load(device, dtype, max_pos).model
    draft = engine.draft.load(device, dtype, max_pos).model
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    kernels = args.kernels if engine.tactics is None else replace(args.kernels, linear_tactics=str(engine.tactics))
    for note in engine.notes:
        print(note)
    record = {"directory": str(args.engine), "git_sha": engine.manifest.git_sha, "tuned": engine.manifest.tuned,
              "tactics_gpu": engine.manifest.tactics_gpu, "tactics_used": str(engine.tactics), "checked_s": checked,
              "load_s": time.perf_counter() - start}
    print(f"engine {args.engine}: checked in {checked:.1f} s, loaded in {record['load_s']:.1f} s, tactics "
          f"{'tuned' if engine.manifest.tuned else 'packaged'}")
    return target, draft, kernels, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="llama-8b")
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--contexts", default="8192,16384,24576,32768,65536")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated registered methods, a speculative one optionally with +fp8kv "
                        f"(default: {','.join(DEFAULT_METHODS)})")
    parser.add_argument("--tau", type=float, default=None, help="one stated mean accepted length for every method "
                        "(default: the paper's per method: Llama 2.8 (Dustin), Classic SD 2.7, MagicDec 2.6 (Table "
                        "10); Qwen 2.2)")
    parser.add_argument("--budget", default=None, help="Dustin's k, comma-separated: every sparse method runs at each "
                        "(m carried over as the same share of the free slots; default: the pair's config's, 512)")
    parser.add_argument("--tau-ratios", default="", help="METHOD=R,...: that method's stated tau is the pair's times R "
                        "(a measured ratio of its tau to the autoregressive draft's on the real pair)")
    parser.add_argument("--gamma", type=int, default=None, help="tokens proposed per round (default: the pair's, 3); "
                        "the stated tau is drawn over Γ + 1 outcomes. LongSpark proposes at most its block (7)")
    parser.add_argument("--ring-layers", type=int, default=4, help="the ring drafter's own layers, of the target's "
                        "shape (the ring method; default: 4, the probe's)")
    parser.add_argument("--ring-head-ids", type=int, default=0, help="the ring drafter proposes from a subset head "
                        "of this many vocabulary ids (0: the whole vocabulary; default: 0)")
    parser.add_argument("--draft-weights", choices=DRAFTER_WEIGHTS, default="model", help="the draft model's layers "
                        "in the model's dtype, or weight-only int8 (its embedding and head stay; default: model)")
    parser.add_argument("--ring-weights", choices=DRAFTER_WEIGHTS, default="model", help="the ring drafter's own "
                        "layers and subset head in the model's dtype, or weight-only int8 (default: model)")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (vanilla: steps) per pass")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON path; a CSV is written beside it")
    parser.add_argument("--engine", type=Path, default=None, help="take the pair's weights and kernel tactic table "
                        "from this engine (`trtllm-dustin build --model TARGET --draft DRAFT [--tune]`)")
    parser.add_argument("--profile-kernels", action="store_true",
                        help="also record per-kernel GPU time (torch.profiler) at the longest context of each method")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages: >= 2 runs every method pipeline-parallel "
                        "over that many processes, one GPU each (pipeline_e2e.py; it starts them itself, or run it "
                        "under torchrun --nproc-per-node PP)")
    parser.add_argument("--micro-batches", type=int, default=1, help="--pp: micro-batches in flight (>= --pp keeps "
                        "every stage busy)")
    parser.add_argument("--first-stage-layers", type=int, default=None, help="--pp: target layers of the first "
                        "stage, which also drafts (the others split the rest evenly); default: an even split")
    parser.add_argument("--pp-timeout", type=float, default=600.0, help="--pp: longest wait for a peer, in seconds")
    add_kernel_switches(parser)
    args = parser.parse_args()
    args.kernels = kernel_config(args)  # recorded with the results
    args.methods = args.methods.split(",")
    try:
        args.budgets = [int(k) for k in args.budget.split(",")] if args.budget else [PAIRS[args.pair].dustin.budget]
    except ValueError:
        raise SystemExit(f"--budget {args.budget!r}: expected comma-separated integers (e.g. 512,1024)") from None
    for k in args.budgets:  # a budget the config cannot take fails here, before the models load
        try:
            PAIRS[args.pair].dustin.with_budget(k)
        except ValueError as error:
            raise SystemExit(f"--budget {k}: {error}") from None
    for method in args.methods:  # a bad +fp8kv name fails here, before the models load
        split_method(method)
    try:
        args.tau_ratios = {k: float(v) for k, v in (item.split("=") for item in args.tau_ratios.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--tau-ratios {args.tau_ratios!r}: expected METHOD=R,... (e.g. longspark=0.9)") from None
    unknown = sorted(set(args.tau_ratios) - set(args.methods))
    if unknown:
        raise SystemExit(f"--tau-ratios names {unknown}, which are not among --methods")
    if args.gamma is not None and not 1 <= args.gamma <= 7:
        raise SystemExit(f"--gamma {args.gamma} must be in [1, 7] (LongSpark's block proposes at most 7 tokens)")
    # the stated tau each method's rounds draw (bench_batch's expression)
    stated = [(args.tau or PAIRS[args.pair].stated_tau(split_method(m)[0])) * args.tau_ratios.get(m, 1.0)
              for m in args.methods if METHODS[split_method(m)[0]].needs_draft]
    gamma = args.gamma or PAIRS[args.pair].gamma
    if any(t > gamma + 1 for t in stated):  # before the models load: stated_acceptance would refuse it later
        raise SystemExit(f"--gamma {gamma}: a stated tau of {max(stated):.2f} cannot be reached; a round commits at "
                         f"most Γ + 1 = {gamma + 1} tokens")
    if args.pp < 1:
        raise SystemExit(f"--pp {args.pp} must be >= 1 (1: one process)")
    vocab = get_preset(PAIRS[args.pair].target.removeprefix("preset:")).vocab_size
    if not 0 <= args.ring_head_ids < vocab:
        raise SystemExit(f"--ring-head-ids {args.ring_head_ids}: give 0 (the whole vocabulary) or fewer ids than "
                         f"the target's {vocab}")
    if args.pp > 1 and args.gamma is not None:
        raise SystemExit("--gamma: the pipeline mode runs the pair's Γ; leave --gamma out with --pp")
    if args.pp > 1:  # every refusal before a rank starts
        import pipeline_e2e

        pipeline_e2e.check_args(args, PAIRS)
        target = PAIRS[args.pair].target.removeprefix("preset:")
        args.longspark_layers = longspark_layers(get_preset(target).num_layers,
                                                 PAIRS[args.pair].dustin.target_layers[0].layer)
        pipeline_e2e.launch(args, PAIRS)
        return
    if args.micro_batches != 1 or args.first_stage_layers is not None:
        raise SystemExit("--micro-batches and --first-stage-layers split a pipeline; pass --pp 2 or more")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pair = replace(PAIRS[args.pair], gamma=gamma)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    t0 = time.perf_counter()
    max_pos = max(contexts) + 4096
    engine_record = None
    if args.engine is not None:  # the pair's weights and tactic table from an engine built for it
        target, draft, args.kernels, engine_record = engine_models(args, pair, device, dtype, max_pos)
    else:
        target = load_model(pair.target, device=device, dtype=dtype, max_positions=max_pos).model
        draft = load_model(pair.draft, device=device, dtype=dtype, max_positions=max_pos, seed=1).model
    quantize_draft(draft, args.draft_weights)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows += bench_batch(pair, target, draft, batch, contexts, args, device, dtype)
    add_speedups(rows)
    where = "h200" if device.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else RESULTS / f"e2e_{args.pair}_{where}.json"
    save_json(out, {**environment(), "pair": args.pair, "target": pair.target, "draft": pair.draft,
                    "gamma": pair.gamma, "ring_layers": args.ring_layers, "ring_head_ids": args.ring_head_ids,
                    "ring_weights": args.ring_weights, "draft_weights": args.draft_weights,
                    **{flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag in SWITCHES},
                    "kernels": json.loads(args.kernels.to_json()), "pdl_supported": pdl_supported(device),
                    "dustin_config": "hand-written placeholder (paper-sized), not searched: "
                    + pair.dustin.to_json(), "budgets": args.budgets,
                    "stated_tau": {m: args.tau or pair.stated_tau(split_method(m)[0]) for m in args.methods},
                    "engine": engine_record, "wall_s": time.perf_counter() - t0,
                    "rows": rows})
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        fields = ["batch", "context", "method", "budget", "tokens_per_s", "speedup_vs_vanilla", "ms_per_round",
                  "tau_stated", "tau_realized", "tokens_per_s_realized", "floor_ms", "fraction_of_floor", "skipped"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
