"""The kernel tactic tuner of an engine build: the skinny-M GEMM's launch configurations timed on the GPU the engine
is built for, at the engine's exact decode shapes, the winners recorded as a tactic table.

As TensorRT's builder picks each layer's tactic by timing the candidates on the target GPU, `trtllm-dustin build
--tune` runs `tune_linear(decode_shapes(target, draft, batch_slots, gamma), device)` and writes the table it returns
into the engine directory; the runtime reads it through `KernelConfig(linear_tactics=PATH)` (schema and lookup:
plugins/linear_tactics.py).

Method (shared with benchmarks/dev/bench_linear.py, the dev sweep over a wider grid that produced the packaged table):
the candidates are compiled first in parallel worker processes (Triton's disk cache), so the timing only times. Each
shape is timed as a CUDA graph of calls cycling over weight copies that exceed twice the L2 (in a decode step every
layer reads its own weights from HBM), the median per call over the graph's replays, F.linear (cuBLAS) and every
candidate in the same process, plain launches (no PDL, which the table's tie rule assumes). A candidate whose output
differs from F.linear's is left out.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from tqdm import tqdm
from triton.errors import TritonError

from trtllm_dustin.config import ModelConfig
from trtllm_dustin.plugins.linear_tactics import LINEAR_TACTICS_SCHEMA_VERSION, LinearConfig, row_block
from trtllm_dustin.plugins.skinny_linear import MAX_ROWS, SplitKWorkspace, skinny_linear_forward

__all__ = ["CALLS_PER_GRAPH", "MIN_SPEEDUP", "REPLAYS", "TIE_MARGIN", "ProjectionShape", "ShapeTiming",
           "decode_shapes", "graph_ms", "linear_candidates", "precompile", "select_entry", "tactic_table",
           "time_shape", "tune_linear"]

CALLS_PER_GRAPH = 24  # calls per timed graph, at least (more where the weight copies that exceed the L2 take more)
_MAX_CALLS_PER_GRAPH = 256  # copies of weights under 0.5 MB (toy models) stop here, inside the L2
REPLAYS = 12  # timed replays per graph; the median is kept
MIN_SPEEDUP = 0.02  # a configuration replaces cuBLAS where it is at least this much faster
TIE_MARGIN = 0.01  # ... and is kept as a tie (taken on PDL launches) where it is at most this much slower
_MAX_ERROR = 2e-2  # max |kernel - F.linear in fp32| / max |F.linear in fp32| of a configuration that is timed
_DTYPE = torch.bfloat16  # the engines' weights; the table's key has no dtype
# The compact grid: every (block_n, block_k) that won a shape in the H200 sweeps of bench_linear's wider grid.
_TILES = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))
_STAGES = (3, 4, 6)
_SPLITS = (2, 3, 4, 6, 8)  # at most 8: the decoder's SplitKWorkspace.for_outputs holds 8 slices
_SPLIT_TILES = ((32, 128), (64, 128))  # the split-K winners' tiles (long-K down projections)
_SPLIT_STAGES = (3, 4)
_SHARED_MEMORY = 200 * 1024  # bytes of the pipelined x and W tiles a configuration may take (H200: 227 KB per SM)


@dataclass(frozen=True)
class ProjectionShape:
    """One decode-sized projection call: y [rows, n] = x [rows, k] @ W [n, k]^T (+ b)."""

    role: str  # which projection of which model, e.g. "target.qkv"
    rows: int  # M: the call's token rows (1 .. MAX_ROWS)
    n: int  # output columns (weight rows)
    k: int  # input columns
    bias: bool = False  # the call adds a bias (Qwen's qkv)
    workspace: bool = False  # the decoder passes a SplitKWorkspace (the down projection): split-K can run

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or not 1 <= self.rows <= MAX_ROWS:
            raise ValueError(f"ProjectionShape {self.role!r}: rows={self.rows!r} must be in 1..{MAX_ROWS}; calls of "
                             "more rows run F.linear whatever a tactic table says, so leave them out")
        for name in ("n", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ProjectionShape {self.role!r}: {name}={value!r} must be an int >= 1")

    @property
    def key(self) -> tuple[int, int, int]:
        """The tactic table's key: (row bucket, n, k)."""
        return row_block(self.rows), self.n, self.k


def _model_projections(prefix: str, config: ModelConfig, layer_rows: Iterable[int], head_rows: Iterable[int]
                       ) -> list[ProjectionShape]:
    """The projections models/decoder.py's fused path runs through skinny_linear: wqkv, wo, w_gate_up, w_down (with
    the split-K workspace) at each of layer_rows, and the output head at each of head_rows; calls of more than
    MAX_ROWS rows run F.linear whatever the table says and are left out."""
    hidden, heads_d = config.hidden_size, config.num_heads * config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = []
    for rows in (rows for rows in layer_rows if rows <= MAX_ROWS):
        shapes += [ProjectionShape(f"{prefix}.qkv", rows, qkv, hidden, bias=config.qkv_bias),
                   ProjectionShape(f"{prefix}.o", rows, hidden, heads_d),
                   ProjectionShape(f"{prefix}.gate_up", rows, 2 * config.intermediate_size, hidden),
                   ProjectionShape(f"{prefix}.down", rows, hidden, config.intermediate_size, workspace=True)]
    return shapes + [ProjectionShape(f"{prefix}.lm_head", rows, config.output_rows(), hidden) for rows in head_rows
                     if rows <= MAX_ROWS]


def decode_shapes(target: ModelConfig, draft: ModelConfig | None, batch_slots: int, gamma: int
                  ) -> list[ProjectionShape]:
    """Every skinny-GEMM call a decode round runs at `batch_slots` sequences, one per tactic-table key, sorted by key.

    The target verifies B * (gamma + 1) rows (logits at every row) and a vanilla step runs B; a draft model's step 0
    runs 2B rows (the last two tokens), steps 1 .. gamma-1 run B, and its head runs on B rows (one per sequence).
    Calls of more than MAX_ROWS rows (F.linear whatever the table says) are left out. Of the calls that share a key,
    the one of most rows is kept (the kernel pads every call of a bucket to its BLOCK_M rows), and it takes split-K
    only where every call of the key has the workspace."""
    if not isinstance(batch_slots, int) or batch_slots < 1:
        raise ValueError(f"batch_slots={batch_slots!r} must be an int >= 1")
    if not isinstance(gamma, int) or gamma < (1 if draft is not None else 0):
        raise ValueError(f"gamma={gamma!r} must be an int >= {1 if draft is not None else 0}"
                         + (" with a draft model (it drafts gamma tokens a round)" if draft is not None else ""))
    B = batch_slots
    calls = _model_projections("target", target, (B * (gamma + 1), B), (B * (gamma + 1), B))
    if draft is not None:
        calls += _model_projections("draft", draft, (2 * B, B) if gamma > 1 else (2 * B,), (B,))
    by_key: dict[tuple[int, int, int], ProjectionShape] = {}
    for call in calls:
        kept = by_key.get(call.key)
        if kept is None:
            by_key[call.key] = call
        else:
            larger = call if call.rows > kept.rows else kept
            by_key[call.key] = ProjectionShape(larger.role, larger.rows, larger.n, larger.k, larger.bias,
                                               kept.workspace and call.workspace)
    return [by_key[key] for key in sorted(by_key)]


def linear_candidates(shape: ProjectionShape, sms: int) -> list[LinearConfig]:
    """The compact grid for one shape on a GPU of `sms` SMs (the H200's sweep winners' tiles and stages; about 20-30
    configurations). Tiles whose x and W stages overflow the shared memory, or whose block_k exceeds K, are left out.
    Orientation: W_tile @ x^T (swap) below 64 rows, where the MMA wants 64 rows that x does not have; x @ W_tile^T at
    64 rows and for 128-column tiles (the output heads' winners). Split-K only where the call has the workspace, with
    at least two K steps per slice and one to four waves of programs over the SMs."""
    block_m = row_block(shape.rows)
    configs = []
    for (block_n, block_k), stages in itertools.product(_TILES, _STAGES):
        if block_k > shape.k or (block_n + block_m) * block_k * _DTYPE.itemsize * stages > _SHARED_MEMORY:
            continue
        warps = 8 if block_n * block_m >= 128 * 64 else 4  # 128 x 64 tiles: the heads' winners at 64 rows
        for swap in (True, False):
            if (swap and block_m < 64) or (not swap and (block_m == 64 or block_n == 128)):
                configs.append(LinearConfig(block_n, block_k, 1, swap, warps, stages))
    if shape.workspace:
        for (block_n, block_k), stages, split in itertools.product(_SPLIT_TILES, _SPLIT_STAGES, _SPLITS):
            programs = -(-shape.n // block_n) * split
            if shape.k // (split * block_k) >= 2 and sms <= programs <= 4 * sms:
                configs.append(LinearConfig(block_n, block_k, split, block_m < 64, 4, stages))
    return configs


def graph_ms(calls: Sequence[Callable[[], object]], replays: int, warmup: int = 3) -> float:
    """Median time of one call: all `calls` captured in one CUDA graph, each replay timed."""
    for call in calls:  # compile and allocate outside capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:<current device>: what worker processes and torch.cuda.device need."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _variant(shape: ProjectionShape, config: LinearConfig) -> tuple:
    """What Triton compiles a launch for: the constexprs, launch options and integer specialisations (multiples of
    16) that skinny_linear_forward gives this call; split_k's value is a runtime argument."""
    return (row_block(shape.rows), shape.k % config.block_k == 0, shape.bias, config.block_n, config.block_k,
            config.split_k > 1, config.swap, config.num_warps, config.num_stages,
            *(value % 16 == 0 for value in (shape.rows, shape.n, shape.k)))


def _compile_variant(job: tuple[ProjectionShape, LinearConfig, str]) -> str | None:
    """Worker: one launch of the configuration on the shape (fills Triton's disk cache); why it failed, or None."""
    shape, config, device_name = job
    device = torch.device(device_name)
    torch.cuda.set_device(device)
    x = torch.randn(shape.rows, shape.k, dtype=_DTYPE, device=device)
    weight = torch.randn(shape.n, shape.k, dtype=_DTYPE, device=device)
    bias = torch.randn(shape.n, dtype=_DTYPE, device=device) if shape.bias else None
    workspace = SplitKWorkspace.allocate(shape.rows, shape.n, config, device) if config.split_k > 1 else None
    try:
        skinny_linear_forward(x, weight, bias, config, workspace)
    except TritonError as error:  # e.g. out of shared memory: reported; time_shape meets it again and leaves it out
        return f"{shape.role} {config}: {type(error).__name__}: {str(error)[:120]}"
    torch.cuda.synchronize()
    return None


def precompile(jobs: Sequence[tuple[ProjectionShape, Sequence[LinearConfig]]], device: torch.device,
               workers: int | None = None, progress: bool = True) -> list[str]:
    """Compile every distinct kernel variant of the (shape, candidates) jobs in `workers` spawned processes (default:
    up to 14, one per CPU core), so that timing finds them in Triton's disk cache; returns the failures."""
    variants = {}
    for shape, configs in jobs:
        for config in configs:
            variants.setdefault(_variant(shape, config), (shape, config, str(_indexed(device))))
    if not variants:
        return []
    workers = workers or min(14, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.map(_compile_variant, variants.values())
        failures = list(tqdm(results, total=len(variants), desc="compiling skinny GEMM variants",
                             disable=not progress))
    return [failure for failure in failures if failure is not None]


@dataclass(frozen=True)
class ShapeTiming:
    """One shape's sweep: F.linear's median per call and each candidate's (microseconds)."""

    shape: ProjectionShape
    cublas_us: float
    kernel_us: dict[LinearConfig, float]  # every candidate that ran and matched F.linear, in candidate order
    failed: dict[LinearConfig, str]  # candidate -> why it was left out (did not compile, launch or match)


def time_shape(shape: ProjectionShape, configs: Sequence[LinearConfig], device: torch.device) -> ShapeTiming:
    """F.linear and every configuration on the shape, each a CUDA graph of calls that cycle over enough weight copies
    to exceed twice the L2 (at most 256), plain launches; the median per call of REPLAYS replays."""
    M, N, K = shape.rows, shape.n, shape.k
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = min(_MAX_CALLS_PER_GRAPH, max(2, -(-2 * l2_bytes // (N * K * _DTYPE.itemsize))))
    weights = [torch.randn(N, K, dtype=_DTYPE, device=device) for _ in range(copies)]
    biases = [torch.randn(N, dtype=_DTYPE, device=device) if shape.bias else None for _ in range(copies)]
    x = torch.randn(M, K, dtype=_DTYPE, device=device)
    y = torch.empty(M, N, dtype=_DTYPE, device=device)
    order = [i % copies for i in range(max(CALLS_PER_GRAPH, copies))]
    ref = F.linear(x.float(), weights[0].float(), None if biases[0] is None else biases[0].float())
    cublas_us = graph_ms([partial(F.linear, x, weights[i], biases[i]) for i in order], REPLAYS) * 1e3
    kernel_us, failed = {}, {}
    for config in configs:
        workspace = SplitKWorkspace.allocate(M, N, config, device) if config.split_k > 1 else None
        try:
            got = skinny_linear_forward(x, weights[0], biases[0], config, workspace, out=y)
        except TritonError as error:  # e.g. out of shared memory on this GPU: that configuration is left out
            failed[config] = f"{type(error).__name__}: {str(error)[:120]}"
            continue
        max_error = ((got.float() - ref).abs().max() / ref.abs().max()).item()  # the one sync per configuration
        if not max_error < _MAX_ERROR:
            failed[config] = f"max error {max_error:.3g} of max |F.linear| (tolerance {_MAX_ERROR})"
            continue
        kernel_us[config] = graph_ms([partial(skinny_linear_forward, x, weights[i], biases[i], config, workspace,
                                              out=y) for i in order], REPLAYS) * 1e3
    del weights, biases
    torch.cuda.empty_cache()  # back to the build: an output head's weight copies take GBs
    return ShapeTiming(shape, cublas_us, kernel_us, failed)


def select_entry(shape: ProjectionShape, cublas_us: float, timings: Mapping[LinearConfig, float]) -> dict:
    """The table entry of a timed shape: the fastest configuration where it is at least MIN_SPEEDUP faster than
    cuBLAS; the same as a tie where it is less so but at most TIE_MARGIN slower; else config None (F.linear)."""
    if not cublas_us > 0 or any(not us > 0 for us in timings.values()):
        raise ValueError(f"{shape.role}: timings must be > 0 us; got cuBLAS {cublas_us} and {dict(timings)}")
    best = min(timings, key=timings.__getitem__) if timings else None  # the first of equal times: candidate order
    kernel_us = None if best is None else timings[best]
    faster = kernel_us is not None and kernel_us <= (1 - MIN_SPEEDUP) * cublas_us
    tie = kernel_us is not None and not faster and kernel_us <= (1 + TIE_MARGIN) * cublas_us
    rows, n, k = shape.key
    return {"rows": rows, "n": n, "k": k, "config": asdict(best) if faster or tie else None, "tie": tie,
            "role": shape.role, "measured_rows": shape.rows, "cublas_us": round(cublas_us, 2),
            "kernel_us": None if kernel_us is None else round(kernel_us, 2)}


_HOW = ("trtllm_dustin.build_engines.tune (trtllm-dustin build --tune): each decode-sized projection of the engine "
        "(the target's verify and vanilla steps, the draft's steps) at its batch, F.linear and every configuration of "
        "the compact grid in the same process, plain (non-PDL) launches in a CUDA graph cycling over weight copies "
        "larger than the L2; cublas_us / kernel_us are the medians per call of F.linear and the fastest configuration")
_SELECTION_RULE = (f"config: the fastest configuration where it was at least {MIN_SPEEDUP:.0%} faster than cuBLAS; "
                   "null (run F.linear) where it was not, unless it tied")
_TIE_RULE = (f"tie: less than {MIN_SPEEDUP:.0%} faster and at most {TIE_MARGIN:.0%} slower than cuBLAS in the "
             "plain-launch sweep; such entries are taken only on PDL launches (KernelConfig.pdl and skinny_pdl on a "
             "device that supports PDL), which hide part of each launch inside a CUDA graph; cuBLAS cannot launch "
             "that way")
_FALLBACK_RULE = ("a shape that is not in this table runs F.linear (cuBLAS): the table holds the engine's decode "
                  "shapes only, and a call of more than 64 rows always runs F.linear")


def tactic_table(entries: Sequence[dict], gpu: str) -> dict:
    """A tactic table file's contents (LinearTactics.from_dict's format): select_entry's entries, measured on `gpu`,
    with the rules they were selected by."""
    return {"schema_version": LINEAR_TACTICS_SCHEMA_VERSION,
            "kernel": "trtllm_dustin.plugins.skinny_linear (plugins/skinny_linear.py)", "gpu": gpu, "how": _HOW,
            "key": "rows = the call's M (rows of x) rounded up to a power of two >= 16 (the kernel's BLOCK_M), "
                   "n = output columns, k = input columns",
            "selection_rule": _SELECTION_RULE, "tie_rule": _TIE_RULE, "fallback_rule": _FALLBACK_RULE,
            "entries": list(entries)}


def tune_linear(shapes: Sequence[ProjectionShape], device: torch.device | str, *,
                candidates: Callable[[ProjectionShape], Sequence[LinearConfig]] | None = None, progress: bool = True,
                workers: int | None = None) -> dict:
    """Time F.linear and every candidate configuration on each shape (candidates: default the compact grid,
    linear_candidates) and return the tactic table (tactic_table), its entries sorted by key. workers: processes
    that pre-compile the candidates (default: up to 14)."""
    shapes = sorted(shapes, key=lambda shape: shape.key)
    for first, second in itertools.pairwise(shapes):
        if first.key == second.key:
            raise ValueError(f"shapes {first.role} and {second.role} share the table key {first.key}; pass one "
                             "shape per key (decode_shapes deduplicates)")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"--tune needs a CUDA device (got {device}); build without --tune to record the packaged "
                         "defaults")
    device = _indexed(device)
    with torch.cuda.device(device):
        if candidates is None:
            candidates = partial(linear_candidates, sms=torch.cuda.get_device_properties(device).multi_processor_count)
        jobs = [(shape, list(candidates(shape))) for shape in shapes]
        precompile(jobs, device, workers=workers, progress=progress)
        entries = []
        for shape, configs in tqdm(jobs, desc="tuning skinny GEMM shapes", disable=not progress):
            timing = time_shape(shape, configs, device)
            entries.append(select_entry(shape, timing.cublas_us, timing.kernel_us))
    return tactic_table(entries, torch.cuda.get_device_name(device))
