"""bench_e2e.py --pp P: the methods' rounds pipeline-parallel over P processes (runtime/pipeline/), one GPU each.

Each rank builds only its own stage of the target (random weights at the pair's shape, `layer_split`, optionally
with --first-stage-layers on the drafting rank) and rank 0 the draft. Every slot starts as if a context had just
been prefilled (PipelineDecoder.bench: the caches hold random K/V, no prefill runs); the last stage commits accepted
counts drawn from the stated distribution (stated_acceptance.py), as the single-process rows do. A method runs a
warm-up bench (the CUDA graphs of the drafter and of each micro-batch's stage forward are captured there), a
throughput pass and a profiling pass (each rank's phases: draft, select, wait, forward, send, accept, commit,
history). Each row also gives the first stage's layer count that would balance its stages by those phases
(`balanced_first_stage`), for a rerun with --first-stage-layers. A row's round time is the slowest rank's wall time
over the timed rounds; its tokens/s is B * tau per
round time at the stated tau, and what the rounds committed is kept beside it.

Launch: `python benchmarks/bench_e2e.py --pp 2 ...` starts the P ranks itself (one per GPU, NCCL; gloo on the
CPU), or run it under `torchrun --nproc-per-node P benchmarks/bench_e2e.py --pp P ...`. Rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from common import RESULTS, environment, save_json
from stated_acceptance import StatedAcceptor, stated_acceptance
from torch import nn

from trtllm_dustin.kv_cache import available_memory
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import Block, Transformer
from trtllm_dustin.models.loading import _random_init
from trtllm_dustin.models.longspark import LongSpark, LongSparkConfig, random_longspark
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.plugins.pdl import pdl_supported
from trtllm_dustin.runtime.build import attention_backend
from trtllm_dustin.runtime.methods import METHODS
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.pipeline import (
    PipelineDecoder,
    PipelineGroup,
    PipelineSetup,
    PipelineStage,
    balanced_first_stage,
    layer_split,
    pipeline_method,
)

__all__ = ["check_args", "launch"]


def check_args(args: argparse.Namespace, pairs: dict) -> None:
    """--pp's refusals, before anything starts: methods the pipeline does not split, fp8 draft caches, a bad
    split."""
    for method in args.methods:
        if "+" in method:
            raise SystemExit(f"--methods {method}: --pp runs the draft cache in the weights' dtype; drop the suffix")
        try:
            pipeline_method(method)
        except Exception as e:  # the pipeline's own message names the methods it splits
            raise SystemExit(f"--methods {method}: {e}") from None
    if args.engine is not None:
        raise SystemExit("--engine with --pp: the pipeline rows use random weights at the pair's shape; drop --engine")
    target = get_preset(pairs[args.pair].target.removeprefix("preset:"))
    try:
        layer_split(target.num_layers, args.pp, args.first_stage_layers)
    except Exception as e:
        raise SystemExit(str(e)) from None
    if args.micro_batches < 1:
        raise SystemExit(f"--micro-batches {args.micro_batches} must be >= 1")


def launch(args: argparse.Namespace, pairs: dict) -> None:
    """Rank RANK of a torchrun launch, or (outside one) start the --pp ranks here and wait for them."""
    if "RANK" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != args.pp:
            raise SystemExit(f"--pp {args.pp} under a launch of {os.environ['WORLD_SIZE']} processes; make them equal")
        _rank(args, pairs)
        return
    import torch.multiprocessing as mp

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.pp:
        raise SystemExit(f"--pp {args.pp} needs {args.pp} GPUs, one per stage; this machine has "
                         f"{torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(rank, args.pp, port, args, pairs)) for rank in range(args.pp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"--pp {args.pp}: rank(s) {failed} failed (their errors are above)")


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, pairs: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        _rank(args, pairs)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def _random_stage(config, start: int, stop: int, rank: int, world: int, device, dtype, max_pos: int,
                  seed: int) -> PipelineStage:
    """The stage's modules on the device in `dtype`, N(0, 1/fan_in) weights, norms at 1 (no full-size copy)."""
    with torch.device("meta"):
        stage = PipelineStage.create(config, start, stop, rank, world, max_pos).to(dtype)
    stage = stage.to_empty(device=device).requires_grad_(False)
    _random_init(stage, seed + rank)  # load_model's random weights, on this stage's parts only
    stage.setup_rope()
    return stage.eval()


def _random_longspark(stage: PipelineStage, config: LongSparkConfig, device, dtype, max_pos: int) -> LongSpark:
    """Rank 0's random LongSpark drafter. Its blocks are target blocks: those of the layers this stage holds, and
    fresh random ones of the layers it does not (a drafter from an engine would carry those blocks; here only their
    shape matters), with the stage's embedding and a random final norm and head."""
    c = stage.config
    with torch.device("meta"):
        donor = Transformer(c, max_pos, layers=range(0), embed=False, head=True).to(dtype)
        fresh = {layer: Block(c).to(dtype) for layer in config.target_layers if not stage.owns(layer)}
    donor = donor.to_empty(device=device)
    fresh = {layer: block.to_empty(device=device) for layer, block in fresh.items()}
    donor.embed = stage.embed
    donor.layers = nn.ModuleList(stage.layers[layer - stage.start] if stage.owns(layer) else
                                 fresh.get(layer, nn.Identity()) for layer in range(c.num_layers))
    gen = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for name, p in [*donor.named_parameters(), *((f"fresh.{n}", p) for b in fresh.values()
                                                     for n, p in b.named_parameters())]:
            if name.startswith(("embed.", "layers.")) and not name.startswith("fresh."):
                continue  # the stage's own weights
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    donor.setup_rope()
    return random_longspark(donor.requires_grad_(False).eval(), seed=2, **{
        k: getattr(config, k) for k in ("target_layers", "window", "summary", "block")})


def _rank(args: argparse.Namespace, pairs: dict) -> None:
    pair = pairs[args.pair]
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    with PipelineGroup.from_env(device_type, timeout_s=args.pp_timeout) as group:
        device, rank = group.device, group.rank
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = get_preset(pair.target.removeprefix("preset:"))
        contexts = sorted(int(c) for c in args.contexts.split(","))
        max_pos = max(contexts) + 4096
        split = layer_split(config.num_layers, group.world, args.first_stage_layers)
        start, stop = split[rank]
        t0 = time.perf_counter()
        stage = _random_stage(config, start, stop, rank, group.world, device, dtype, max_pos, seed=0)
        needs_draft = any(METHODS[m].needs_draft for m in args.methods)
        draft_config = get_preset(pair.draft.removeprefix("preset:")) if needs_draft else None
        draft = load_model(pair.draft, device=device, dtype=dtype, max_positions=max_pos, seed=1).model \
            if needs_draft and group.first else None
        spark, spark_config = None, None
        if any(METHODS[m].needs_longspark for m in args.methods):
            spark_config = LongSparkConfig(target_layers=args.longspark_layers)
            if group.first:
                spark = _random_longspark(stage, spark_config, device, dtype, max_pos)
        backend = attention_backend(device, args.kernels)
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            rows += _bench_batch(args, pair, group, stage, draft, draft_config, split, backend, batch, contexts,
                                 dtype, spark, spark_config)
        if group.first:
            _save(args, pair, split, rows, time.perf_counter() - t0, device)
        group.barrier()  # the ranks leave together, after rank 0 has written


def _longest(group, stage, draft_config, batch: int, contexts: list[int], margin: int, dtype) -> int | None:
    """The longest context whose caches fit on every rank (this stage's layers; rank 0 also the draft's)."""
    c, size = stage.config, torch.empty(0, dtype=dtype).element_size()
    per_token = c.kv_bytes_per_token(size) * stage.num_local_layers // c.num_layers * batch
    if group.first and draft_config is not None:
        per_token += draft_config.kv_bytes_per_token(size) * batch
    free = available_memory(group.device) - (6 << 30 if group.device.type == "cuda" else 1 << 30)
    fits = [ctx for ctx in contexts if per_token * (ctx + margin) <= free]
    mine = [max(fits) if fits else -1]
    everyone = [None] * group.world
    dist.all_gather_object(everyone, mine)
    longest = min(e[0] for e in everyone)
    return None if longest < 0 else longest


def _bench_batch(args, pair, group, stage, draft, draft_config, split, backend, batch: int, contexts: list[int],
                 dtype, spark, spark_config) -> list[dict]:
    gamma, rounds = pair.gamma, args.rounds
    margin = (rounds + 4) * (gamma + 1) + 64
    longest = _longest(group, stage, draft_config, batch, contexts, margin, dtype)
    rows = [{"batch": batch, "context": c, "pp": group.world, "skipped": "KV caches do not fit on every rank"}
            for c in contexts if longest is None or c > longest]
    if longest is None:
        return rows
    S = longest + margin
    cuda = group.device.type == "cuda"
    runs = [(m, b) for m in args.methods for b in (args.budgets if METHODS[m].sparse else [None])]
    for method, budget in runs:
        dustin = pair.dustin.with_budget(budget) if budget is not None else pair.dustin
        decoder = PipelineDecoder(PipelineSetup(
            method, stage, group, backend, batch, S, draft_config=draft_config if METHODS[method].needs_draft
            else None, draft=draft if METHODS[method].needs_draft else None, gamma=gamma, dustin=dustin,
            micro_batches=args.micro_batches, kv_dtype=dtype, use_cuda_graph=cuda, kernels=args.kernels,
            layers=tuple(split), longspark_config=spark_config if METHODS[method].needs_longspark else None,
            longspark=spark if METHODS[method].needs_longspark else None))
        with torch.inference_mode():  # random K/V: the attention reads what a prefilled cache would hold
            for mb in decoder.micro:
                mb.cache.k.normal_()
                mb.cache.v.normal_()
        ratio = args.tau_ratios.get(method, 1.0)
        tau = (args.tau or pair.stated_tau(method)) * ratio if decoder.gamma else 1.0
        probs, alpha = stated_acceptance(tau, gamma) if decoder.gamma else (None, None)
        for context in [c for c in contexts if c <= longest]:
            passes = {}
            for profile in (None, False, True):  # warm-up (graph capture), throughput, profile
                acceptor = StatedAcceptor(probs.to(group.device), seed=0, use_kernel=args.kernels.round_kernels) \
                    if group.last and decoder.gamma else None
                timer = PhaseTimer(bool(profile), group.device)
                out = decoder.bench(context, 2 if profile is None else rounds, acceptor, timer, seed=context)
                if profile is not None:
                    passes[profile] = (out, timer.totals_ms())
            mine = {"ms": passes[False][0].ms, "committed": passes[False][0].committed,
                    "phases": {k: v / rounds for k, v in passes[True][1].items()},
                    "layers": [stage.start, stage.stop]}
            everyone = [None] * group.world
            dist.all_gather_object(everyone, mine)
            ms = max(e["ms"] for e in everyone) / rounds
            row = {"batch": batch, "context": context, "method": method, "budget": budget, "pp": group.world,
                   "micro_batches": args.micro_batches, "ms_per_round": ms,
                   "tokens_per_s": batch * tau / ms * 1e3,
                   # the rounds' commits (the first token of each slot came before the clock)
                   "tokens_per_s_realized": (everyone[-1]["committed"] - batch) / max(e["ms"] for e in everyone)
                   * 1e3,
                   "tau_realized": (everyone[-1]["committed"] - batch) / (batch * rounds) if rounds else None,
                   "rank_ms_per_round": [e["ms"] / rounds for e in everyone],
                   "rank_layers": [e["layers"] for e in everyone],
                   "rank_phase_ms_per_round": [e["phases"] for e in everyone]}
            row["balanced_first_stage_layers"] = _balanced(split, everyone, stage.config.num_layers)
            if decoder.gamma:
                label = "stated tau (random weights)" if method not in args.tau_ratios else \
                    f"stated tau x measured ratio {ratio:.3f} (random weights)"
                row.update(tau_stated=tau, alpha=alpha, acceptance=label)
            rows.append(row)
            if group.first:
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "rank_phase_ms_per_round"}, flush=True)
        del decoder
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _balanced(split, everyone: list[dict], num_layers: int) -> dict:
    """The first stage's layer count that would balance this row's stages (layers.balanced_first_stage), from its
    profiled phases: one layer's forward from rank 0's (its embedding is a gather), rank 0's drafting and selection,
    and the last stage's forward beyond its layers (the head) plus acceptance."""
    first, last = everyone[0]["phases"], everyone[-1]["phases"]
    layer_ms = first.get("forward", 0.0) / (split[0][1] - split[0][0])
    first_extra = first.get("draft", 0.0) + first.get("select", 0.0)
    last_layers = split[-1][1] - split[-1][0]
    last_extra = max(0.0, last.get("forward", 0.0) - last_layers * layer_ms) + last.get("accept", 0.0)
    if layer_ms <= 0:
        return {"layers": None, "why": "no forward time was profiled"}
    return {"layers": balanced_first_stage(num_layers, len(split), first_extra, layer_ms, last_extra),
            "layer_ms": layer_ms, "first_extra_ms": first_extra, "last_extra_ms": last_extra}


def _save(args, pair, split, rows: list[dict], wall_s: float, device) -> None:
    vanilla = {(r["batch"], r["context"]): r["tokens_per_s"] for r in rows if r.get("method") == "vanilla"}
    for r in rows:
        if "tokens_per_s" in r and (r["batch"], r["context"]) in vanilla:
            r["speedup_vs_vanilla"] = r["tokens_per_s"] / vanilla[(r["batch"], r["context"])]
    where = f"h200x{args.pp}" if device.type == "cuda" else f"cpu_pp{args.pp}"
    out = Path(args.out) if args.out else RESULTS / f"e2e_{args.pair}_{where}.json"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device.type == "cuda" else []
    save_json(out, {**environment(), "pair": args.pair, "target": pair.target, "draft": pair.draft,
                    "gamma": pair.gamma, "pp": args.pp, "gpus": gpus, "layer_split": [list(r) for r in split],
                    "micro_batches": args.micro_batches, "first_stage_layers": args.first_stage_layers,
                    "kernels": json.loads(args.kernels.to_json()), "pdl_supported": pdl_supported(device),
                    "dustin_config": "hand-written placeholder (paper-sized), not searched: " + pair.dustin.to_json(),
                    "budgets": args.budgets,
                    "stated_tau": {m: args.tau or pair.stated_tau(m) for m in args.methods},
                    "wall_s": wall_s, "rows": rows})
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        fields = ["batch", "context", "method", "budget", "pp", "micro_batches", "tokens_per_s", "speedup_vs_vanilla",
                  "ms_per_round", "tau_stated", "tau_realized", "tokens_per_s_realized", "skipped"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
