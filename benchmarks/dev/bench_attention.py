"""Attention kernels on the paper's shapes: full-cache vs sparse (k = 512) verification vs torch
SDPA, and the SRH estimator's cost as a fraction of full verification attention over all layers.

    python benchmarks/dev/bench_attention.py [--sweep] [--out benchmarks/results/attention_h200.json]

Timing: our ops inside a captured CUDA graph (several calls per graph, replays timed one by one
with CUDA events, median, warm-up replays excluded); SDPA eagerly with CUDA events (it runs for
milliseconds, so launch overhead does not matter). Sparse calls cycle over 8 (q, indices) sets 4 times,
so the ~35 MB one call gathers is not served from the 60 MB L2; every full-cache case reads
more than twice the L2. Bandwidth counts bytes the kernel must read (K and V rows it attends to,
q and the indices) against the measured 4.26 TB/s device copy ceiling. The ops launch as the decoder launches
them: with PDL where the KernelConfig (TRTLLM_DUSTIN_PDL, KernelConfig.from_env) has it on. The --sweep grids call
the launchers (`*_forward`) with explicit launch parameters; what each run found is in benchmarks/dev/README.md.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import graph_ms  # noqa: E402

from trtllm_dustin.plugins import sparse_verify_attention, srh_score, verify_attention  # noqa: E402
from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.pdl import pdl_supported  # noqa: E402
from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward  # noqa: E402
from trtllm_dustin.plugins.srh_score import srh_score_forward  # noqa: E402
from trtllm_dustin.plugins.verify_attention import verify_attention_forward  # noqa: E402

COPY_CEILING_TBS = 4.26  # measured device-to-device copy, bytes read + written (shared/GPU.md)
SPARSE_ROTATION = 8
SPARSE_PASSES = 4
KERNELS = KernelConfig.from_env()
PDL = KERNELS.pdl  # what the attention backend passes the ops


def full_launch(*args, **launch):
    """verify_attention_forward as the op launches it (PDL per KERNELS) unless `launch` says otherwise."""
    return verify_attention_forward(*args, **{"pdl": PDL, **launch})


def sparse_launch(*args, **launch):
    """sparse_verify_attention_forward as the op launches it (PDL per KERNELS) unless `launch` says otherwise."""
    return sparse_verify_attention_forward(*args, **{"pdl": PDL, **launch})


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    layers: int


@dataclass(frozen=True)
class EstimatorPair:
    """Paper App. A: 1 target layer x 4 SRHs x 1 query, 3 draft layers x 4 SRHs x gamma queries."""
    target: str
    draft: AttentionShape
    gamma: int
    target_layers_scored: int = 1
    draft_layers_scored: int = 3
    heads_scored: int = 4


TARGETS = {
    "Llama-3.1-8B": AttentionShape("Llama-3.1-8B", 32, 8, 128, 32),
    "Qwen2.5-7B": AttentionShape("Qwen2.5-7B", 28, 4, 128, 28),
    "Qwen2.5-72B": AttentionShape("Qwen2.5-72B", 64, 8, 128, 80),
}
PAIRS = [
    EstimatorPair("Qwen2.5-72B", AttentionShape("Qwen2.5-0.5B", 14, 2, 64, 24), gamma=4),
    EstimatorPair("Llama-3.1-8B", AttentionShape("Llama-3.2-1B", 32, 8, 64, 16), gamma=3),
]


def spread_heads(shape: AttentionShape, n: int) -> tuple[int, ...]:
    """n query heads on as many distinct KV heads as possible: the most K bytes to read."""
    group = shape.heads_q // shape.heads_kv
    heads = [(i % shape.heads_kv) * group + i // shape.heads_kv for i in range(n)]
    return tuple(heads)


def events_ms(call, replays: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tbs(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def random_indices(batch: int, length: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted distinct positions of [0, length) per sequence, as selection produces them."""
    scores = torch.rand(batch, length, generator=generator, device="cuda")
    return scores.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)


def sdpa_call(q, k_cache, v_cache, length, t):
    """torch SDPA on the same problem: [B, H, T, D] queries over the first L + T cache rows."""
    q_sdpa = q.transpose(1, 2)
    keys, values = k_cache[:, :, : length + t], v_cache[:, :, : length + t]
    positions = torch.arange(length + t, device="cuda")
    mask = positions[None, :] <= length + torch.arange(t, device="cuda")[:, None]  # [T, L + T]
    return lambda: F.scaled_dot_product_attention(q_sdpa, keys, values, attn_mask=mask, enable_gqa=True)


def bench_case(shape, batch, length, t, k, k_cache, v_cache, generator, replays):
    """One row: full verify, sparse verify (k), SDPA, for one target shape / batch / length / T."""
    dtype, d = k_cache.dtype, shape.head_dim
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, t, shape.heads_q, d, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    full_ms = graph_ms([lambda: verify_attention(q, k_cache, v_cache, seqlens, out=out, pdl=PDL)] * 4, replays)
    elem = k_cache.element_size()
    full_bytes = 2 * batch * shape.heads_kv * (length + t) * d * elem + 2 * q.numel() * elem
    ours = out.clone()

    qs = [torch.randn_like(q) for _ in range(SPARSE_ROTATION)]
    index_sets = [random_indices(batch, length, k, generator) for _ in range(SPARSE_ROTATION)]
    outs = [torch.empty_like(q) for _ in range(SPARSE_ROTATION)]
    sparse_calls = [
        (lambda qi=qi, ii=ii, oi=oi: sparse_verify_attention(qi, k_cache, v_cache, seqlens, ii, out=oi, pdl=PDL))
        for qi, ii, oi in zip(qs, index_sets, outs, strict=True)
    ]
    # The 8 sets cycled SPARSE_PASSES times per graph: a set comes back only after the 7 others (117 MB of
    # K/V rows at B = 16 with 8 KV heads, about twice the L2), and each replay averages 32 launches instead of
    # 8 (with 8, the per-launch time moved by +-2 us between cases of the same size).
    sparse_ms = graph_ms(sparse_calls * SPARSE_PASSES, replays * 2)
    sparse_bytes = 2 * batch * shape.heads_kv * (k + t) * d * elem + 2 * q.numel() * elem + batch * k * 4

    row = {
        "model": shape.name, "heads_q": shape.heads_q, "heads_kv": shape.heads_kv, "head_dim": d,
        "batch": batch, "context": length, "tokens": t, "k": k,
        "full_ms": full_ms, "full_gb": full_bytes / 1e9, "full_tbs": tbs(full_bytes, full_ms),
        "full_frac_of_copy_ceiling": tbs(full_bytes, full_ms) / COPY_CEILING_TBS,
        "full_floor_ms": full_bytes / (COPY_CEILING_TBS * 1e12) * 1e3,
        "sparse_ms": sparse_ms, "sparse_tbs": tbs(sparse_bytes, sparse_ms),
        "sparse_frac_of_copy_ceiling": tbs(sparse_bytes, sparse_ms) / COPY_CEILING_TBS,
        "sparse_speedup_vs_full": full_ms / sparse_ms,
    }
    try:
        sdpa = sdpa_call(q, k_cache, v_cache, length, t)
        reference = sdpa().transpose(1, 2)
        row["full_vs_sdpa_rel_err"] = ((ours.float() - reference.float()).norm() / reference.float().norm()).item()
        row["sdpa_ms"] = events_ms(sdpa, max(5, replays // 2))
        row["full_speedup_vs_sdpa"] = row["sdpa_ms"] / full_ms
        del reference
    except torch.OutOfMemoryError:
        row["sdpa_ms"] = None
        row["sdpa_error"] = "out of memory"
    torch.cuda.empty_cache()
    return row


def bench_estimator(pair, batch, length, target_cache, full_ms, generator, replays):
    """SRH estimator (Eq. 5 on SRHs) vs full verification attention summed over all target layers."""
    target = TARGETS[pair.target]
    draft = pair.draft
    dtype = target_cache.dtype
    s_max = target_cache.shape[2]
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    target_heads = spread_heads(target, pair.heads_scored)
    draft_heads = spread_heads(draft, pair.heads_scored)
    q_target = torch.randn(batch, 1, target.heads_q, target.head_dim, device="cuda", dtype=dtype)
    draft_layers = []
    for _ in range(pair.draft_layers_scored):
        k_draft = torch.randn(batch, draft.heads_kv, s_max, draft.head_dim, device="cuda", dtype=dtype)
        q_draft = torch.randn(batch, pair.gamma, draft.heads_q, draft.head_dim, device="cuda", dtype=dtype)
        # lse from drafting: the draft's attention over [0, L + t] for each of its gamma queries
        _, lse = verify_attention(q_draft, k_draft, k_draft, seqlens, return_lse=True)
        draft_layers.append((q_draft, k_draft, lse))
    s_target = torch.empty(batch, s_max, device="cuda")
    s_draft = torch.empty(batch, s_max, device="cuda")
    _, lse_target = verify_attention(q_target, target_cache, target_cache, seqlens, return_lse=True)
    scale_target = 1 / math.sqrt(target.head_dim)

    def target_two_pass():  # recomputes the scores from K: two reads of K, nothing per head stored
        srh_score_forward(q_target, target_cache, seqlens, target_heads, None, scale_target, s_target, False,
                          raw_scores=False)

    def target_raw():  # the default without lse: one read of K, the 4 heads' score rows kept (fp32)
        srh_score(q_target, target_cache, seqlens, target_heads, out=s_target)

    def target_one_pass():
        srh_score(q_target, target_cache, seqlens, target_heads, lse=lse_target, out=s_target)

    def draft_scores():  # lse from drafting (the draft's attention over [0, L + t] for its Γ queries)
        for i, (q_draft, k_draft, lse) in enumerate(draft_layers):
            srh_score(q_draft, k_draft, seqlens, draft_heads, lse=lse, out=s_draft, accumulate=i > 0)

    def draft_scores_no_lse():  # what runtime/dustin.py calls: no lse handed over from drafting
        for i, (q_draft, k_draft, _) in enumerate(draft_layers):
            srh_score(q_draft, k_draft, seqlens, draft_heads, out=s_draft, accumulate=i > 0)

    target_two_ms = graph_ms([target_two_pass], replays)
    target_raw_ms = graph_ms([target_raw], replays)
    target_one_ms = graph_ms([target_one_pass], replays)
    draft_ms = graph_ms([draft_scores], replays)
    draft_no_lse_ms = graph_ms([draft_scores_no_lse], replays)
    estimator_ms = graph_ms([lambda: (target_raw(), draft_scores())], replays)
    runtime_ms = graph_ms([lambda: (target_raw(), draft_scores_no_lse())], replays)
    strict_ms = graph_ms([lambda: (target_two_pass(), draft_scores())], replays)
    full_all_layers_ms = target.layers * full_ms
    return {
        "target": pair.target, "draft": draft.name, "gamma": pair.gamma, "batch": batch, "context": length,
        "target_heads": list(target_heads), "draft_heads": list(draft_heads),
        "target_score_two_pass_ms": target_two_ms, "target_score_raw_ms": target_raw_ms,
        "target_score_one_pass_ms": target_one_ms,
        "draft_scores_3_layers_ms": draft_ms, "draft_scores_3_layers_no_lse_ms": draft_no_lse_ms,
        "estimator_ms": estimator_ms,
        "estimator_desc": "target: 1 query x 4 heads without lse (one read of K + the heads' score rows); "
                          "draft: Γ queries x 4 heads x 3 layers with lse from drafting",
        "estimator_runtime_ms": runtime_ms,
        "estimator_runtime_desc": "as runtime/dustin.py calls it: no lse on either side (one read of K each)",
        "estimator_strict_two_pass_ms": strict_ms,
        "estimator_strict_desc": "target scored by two reads of K, no per-head rows stored; draft as estimator_ms",
        "full_verify_per_layer_ms": full_ms, "full_verify_all_layers_ms": full_all_layers_ms,
        "estimator_frac_of_full_verify": estimator_ms / full_all_layers_ms,
        "estimator_runtime_frac_of_full_verify": runtime_ms / full_all_layers_ms,
        "estimator_strict_frac_of_full_verify": strict_ms / full_all_layers_ms,
    }


def make_problem(shape, batch, length, t, dtype=torch.bfloat16, kv_pairs=False):
    """kv_pairs: K and V of one (sequence, head, position) side by side in memory ([B, H, S, 2, D], K and V strided
    views of it), so a gathered position is one contiguous 2 * D row instead of two rows in separate tensors."""
    if kv_pairs:
        kv = torch.randn(batch, shape.heads_kv, length + 16, 2, shape.head_dim, device="cuda", dtype=dtype)
        k_cache, v_cache = kv[:, :, :, 0], kv[:, :, :, 1]
    else:
        k_cache = torch.randn(batch, shape.heads_kv, length + 16, shape.head_dim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, t, shape.heads_q, shape.head_dim, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, seqlens


def timed(rows, label, calls, **record):
    """Time `calls` in a graph and append a sweep row; an infeasible config is recorded, not fatal."""
    try:
        ms = graph_ms(calls, 30)
    except Exception as error:  # e.g. out of shared memory for this tile shape
        rows.append({**record, "error": str(error)[:200]})
        return
    rows.append({**record, "ms": ms})
    print(f"sweep {label}: {' '.join(f'{k}={v}' for k, v in record.items())}: {ms * 1e3:8.1f} us", flush=True)


def sweep_sparse(generator, rows, batch=16, length=32768):
    """Sparse launch parameters on Qwen2.5-72B heads, and time against k (intercept = fixed cost)."""
    shape = TARGETS["Qwen2.5-72B"]
    # Run 2 settled block_m=64 and index prefetch; run 3 (at 2a61390) also tried K/V register prefetch and
    # a separate new-token tile, neither kept (attention_h200.sweep3.json). This grid re-checks the rest.
    # Run 4 tried key splits merged inside the kernel (fused_combine): 2 splits 19-23 us against 17 us for one
    # (attention_h200.sweep4.json). Run 5 (385045e) tried deeper software pipelines: num_stages 4 / 5 were 0.6-2 us
    # slower than 3. Run 6 folds the T new tokens in after the walk (new_separate: their K/V gathered before it),
    # so k = 512 walks 8 tiles of 64 instead of 8 and a ninth holding only the new tokens: 16.4 vs 17.2 us at T=4,
    # 18.5 vs 16.8 at T=5 (e3ecf4a), not kept. Run 7 lets the software pipeliner schedule the index load -> gather
    # chain itself over 4-6 stages (no hand prefetch of the next indices), which runs 2-3 never tried past 3 stages.
    # Those were 1-7 us slower (attention_h200.sweep7.json); new_separate is kept for tiles of <= 32 rows (6485c25).
    # Run 8: at T = 5 (40 rows) two row blocks of 32 (or three of 16), each folding the new tokens in after the walk,
    # against one 64-row block without it (the default); the blocks of a pair gather the same rows (L2 repeats).
    configs = [dict(block_m=bm, block_n=64, num_stages=3, num_warps=4, num_splits=1, new_separate=sep)
               for bm in (64, 32, 16) for sep in (False, True)]
    for t in (5, 4):
        q, k_cache, v_cache, seqlens = make_problem(shape, batch, length, t)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        scale = 1 / math.sqrt(shape.head_dim)
        index_sets = [random_indices(batch, length, 512, generator) for _ in range(SPARSE_ROTATION)]
        for kw in configs:
            calls = [partial(sparse_launch, q, k_cache, v_cache, seqlens, ii, scale, out, lse, **kw)
                     for ii in index_sets]
            timed(rows, "sparse", calls, kind="sparse", tokens=t, **kw)
        for k in (0, 128, 512, 2048):
            sets = [random_indices(batch, length, k, generator) for _ in range(SPARSE_ROTATION)]
            calls = [partial(sparse_verify_attention, q, k_cache, v_cache, seqlens, ii, out=out, pdl=PDL)
                     for ii in sets]
            timed(rows, "sparse-k", calls, kind="sparse_vs_k", tokens=t, k=k)
        torch.cuda.empty_cache()


def sweep_full_splits(rows):
    """Split counts around the heuristic for a few pair counts (B * H_kv = 32, 64, 128)."""
    for name, batch, t in (("Qwen2.5-7B", 8, 5), ("Qwen2.5-7B", 16, 4), ("Llama-3.1-8B", 16, 4)):
        shape = TARGETS[name]
        q, k_cache, v_cache, seqlens = make_problem(shape, batch, 32768, t)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        for splits in (None, 1, 2, 3, 4, 6, 8, 16):
            call = partial(full_launch, q, k_cache, v_cache, seqlens, 1 / math.sqrt(shape.head_dim), out, lse,
                           num_splits=splits)
            timed(rows, "full", [call] * 2, kind="full_splits", model=name, batch=batch, tokens=t, num_splits=splits)
        torch.cuda.empty_cache()


def sweep_draft_decode(rows, batch=16, length=32768):
    """The full kernel on the draft's heads (Llama-3.2-1B: 32 / 8, D = 64), T = 1 (a draft step) and 2: the key tile
    (block_n) and warps, against the default (block_n 128 at D = 64: a 16 KB K tile, half the D = 128 tile's bytes)."""
    shape = PAIRS[1].draft
    for t in (1, 2):
        q, k_cache, v_cache, seqlens = make_problem(shape, batch, length, t)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        elem = k_cache.element_size()
        nbytes = 2 * batch * shape.heads_kv * (length + t) * shape.head_dim * elem
        for n, w, st in ((None, None, 3), (128, 4, 3), (128, 4, 4), (256, 4, 3), (256, 8, 3), (256, 4, 2),
                         (64, 4, 3)):
            call = partial(full_launch, q, k_cache, v_cache, seqlens, 1 / math.sqrt(shape.head_dim), out, lse,
                           block_n=n, num_warps=w, num_stages=st)
            timed(rows, "draft", [call] * 4, kind="draft_decode", model=shape.name, batch=batch, tokens=t,
                  block_n=n, num_warps=w, num_stages=st)
            if "ms" in rows[-1]:
                rows[-1]["frac_of_copy_ceiling"] = tbs(nbytes, rows[-1]["ms"]) / COPY_CEILING_TBS
        torch.cuda.empty_cache()


def sweep_srh(rows, batch=16, length=32768):
    """SRH kernels' block sizes on the estimator's two shapes (target T=1, draft T=gamma)."""
    pair = PAIRS[0]
    for shape, t in ((TARGETS[pair.target], 1), (pair.draft, pair.gamma)):
        q, k_cache, v_cache, seqlens = make_problem(shape, batch, length, t)
        heads = spread_heads(shape, pair.heads_scored)
        _, lse = verify_attention(q, k_cache, v_cache, seqlens, return_lse=True)
        out = torch.empty(batch, k_cache.shape[2], device="cuda")
        scale = 1 / math.sqrt(shape.head_dim)
        for n in (64, 128, 256):
            for w in (4, 8):
                for st in (2, 3):
                    for given in (lse, None) if shape.head_dim == 128 else (lse,):
                        call = partial(srh_score_forward, q, k_cache, seqlens, heads, given, scale, out, False,
                                       block_n=n, num_warps=w, num_stages=st)
                        timed(rows, "srh", [call], kind="srh", model=shape.name, tokens=t, block_n=n, num_warps=w,
                              num_stages=st, two_pass=given is None)
        torch.cuda.empty_cache()


def sweep_acceptance_case(generator, rows, label, full_configs, sparse_configs, rounds, batch=16, length=32768,
                          layouts=(False,), model="Qwen2.5-72B"):
    """Launch variants on the acceptance case (Qwen2.5-72B heads, B=16, 32K, k=512), timed as the table times it, in
    `rounds` interleaved rounds: each round times every full-kernel config (4 calls per graph), then every sparse one
    (8 (q, indices) sets x 4 passes per graph). sparse_configs: {T: [launch keywords]}; layouts: kv_pairs values
    (make_problem), each timed in turn within a round; model: another target's heads."""
    shape = TARGETS[model]
    scale = 1 / math.sqrt(shape.head_dim)
    for t, configs in sparse_configs.items():
        problems = {pairs: make_problem(shape, batch, length, t, kv_pairs=pairs) for pairs in layouts}
        q, _, _, seqlens = problems[layouts[0]]
        lse = torch.empty(q.shape[:3], device="cuda")
        qs = [torch.randn_like(q) for _ in range(SPARSE_ROTATION)]
        outs = [torch.empty_like(q) for _ in range(SPARSE_ROTATION)]
        index_sets = [random_indices(batch, length, 512, generator) for _ in range(SPARSE_ROTATION)]
        for _, (pairs, (_, k_cache, v_cache, _)) in itertools.product(range(rounds), problems.items()):
            layout = {"kv_pairs": True} if pairs else {}
            for kw in full_configs:
                call = partial(full_launch, q, k_cache, v_cache, seqlens, scale, outs[0], lse, **kw)
                timed(rows, f"{label}-full", [call] * 4, kind=f"{label}_full", model=model, tokens=t, **layout, **kw)
            for kw in configs:
                calls = [partial(sparse_launch, qi, k_cache, v_cache, seqlens, ii, scale, oi, lse, **kw)
                         for qi, ii, oi in zip(qs, index_sets, outs, strict=True)]
                timed(rows, f"{label}-sparse", calls * SPARSE_PASSES, kind=f"{label}_sparse", model=model, tokens=t,
                      **layout, **kw)
        del q, problems
        torch.cuda.empty_cache()


def sweep_pdl(generator, rows):
    """Programmatic dependent launch, every config twice: pdl off / on for the full and the sparse kernel, and at T=5
    new_separate with PDL. Runs 9 and 11 (attention_h200.sweep9/11.json) also timed the sparse kernel signalling the
    next launch right after its walk (pdl_trigger) and a 64-row tile at T=4 (wide_tile); both launcher options were
    removed, git ba29b41 holds them."""
    sweep_acceptance_case(generator, rows, "pdl", [dict(pdl=False), dict(pdl=True)],
                          {4: [dict(pdl=False), dict(pdl=True)],
                           5: [dict(pdl=False), dict(pdl=True), dict(pdl=True, new_separate=True)]}, rounds=2)


# The sparse launcher's defaults before run 19 (block_m 64 cut to the smallest tile of T * G rows, no lean), which runs
# 12-19 compared against (dict() in their configs meant these then).
SPARSE_DEFAULT_BEFORE_RUN_19 = dict(block_m=64, lean=False)


@triton.jit
def _gather_rows_kernel(k_ptr, v_ptr, idx_ptr, out_ptr, stride_kb, stride_kh, stride_ks, stride_ib, num_kv_heads,
                        num_indices, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Read-only gather: the K and V rows of a (sequence, KV head) pair's index list, split over the grid's first axis
    in BLOCK_N-row tiles, summed into one float per program (so nothing but the gathers moves bytes)."""
    chunks = tl.num_programs(0)
    pair = tl.program_id(1)
    b = pair // num_kv_heads
    kv_head = pair % num_kv_heads
    per_chunk = tl.cdiv(tl.cdiv(num_indices, chunks), BLOCK_N) * BLOCK_N
    start = tl.program_id(0) * per_chunk
    end = tl.minimum(start + per_chunk, num_indices)
    offs_d = tl.arange(0, HEAD_DIM)
    base = b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        pos = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + offs_n, mask=ok, other=0)
        rows = base + pos[:, None] * stride_ks + offs_d[None, :]
        acc += tl.load(k_ptr + rows, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + rows, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + pair * chunks + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def gather_rows(k_cache, v_cache, indices, out, chunks, block_n=64, num_warps=4, num_stages=3):
    """The sparse kernel's K/V reads alone (same caches, same index lists), `chunks` programs per pair."""
    batch, heads_kv = k_cache.shape[:2]
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"gather_rows: K strides {k_cache.stride()} differ from V strides {v_cache.stride()}")
    _gather_rows_kernel[(chunks, batch * heads_kv)](
        k_cache, v_cache, indices, out, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), indices.stride(0),
        heads_kv, indices.shape[1], HEAD_DIM=k_cache.shape[3], BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages)


def sweep_gather(generator, rows, batch=16, length=32768, k=512, variants=None, rounds=2):
    """Run 14: how fast the acceptance case's K/V rows can be gathered at all (no attention math), by programs per
    pair and pipeline depth, beside the sparse kernel on the same lists (two interleaved rounds)."""
    shape = TARGETS["Qwen2.5-72B"]
    q, k_cache, v_cache, seqlens = make_problem(shape, batch, length, 5)
    index_sets = [random_indices(batch, length, k, generator) for _ in range(SPARSE_ROTATION)]
    sums = torch.empty(batch * shape.heads_kv * 64, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    nbytes = 2 * batch * shape.heads_kv * k * shape.head_dim * k_cache.element_size()
    if variants is None:  # (chunks, num_stages, block_n, num_warps)
        variants = [(1, 3, 64, 4), (1, 2, 64, 4), (1, 4, 64, 4), (2, 3, 64, 4), (4, 3, 64, 4), (8, 3, 64, 4),
                    (8, 2, 64, 4), (1, 3, 32, 4), (4, 3, 32, 4), (16, 2, 32, 4)]
    for _ in range(rounds):
        calls = [partial(sparse_launch, q, k_cache, v_cache, seqlens, ii, 1 / math.sqrt(128), out, lse,
                         **SPARSE_DEFAULT_BEFORE_RUN_19) for ii in index_sets]
        timed(rows, "gather", calls * SPARSE_PASSES, kind="gather_sparse_kernel", tokens=5)
        for chunks, stages, n, warps in variants:
            calls = [partial(gather_rows, k_cache, v_cache, ii, sums, chunks, block_n=n, num_stages=stages,
                             num_warps=warps) for ii in index_sets]
            timed(rows, "gather", calls * SPARSE_PASSES, kind="gather", chunks=chunks, num_stages=stages, block_n=n,
                  num_warps=warps)
            if "ms" in rows[-1]:
                rows[-1]["tbs"] = tbs(nbytes, rows[-1]["ms"])
    del k_cache, v_cache
    torch.cuda.empty_cache()


def sweep_resident_splits(generator, rows):
    """Run 15: the read-only gather ran 12 us with 2 programs per pair against 17 us with one (run 14): key splits with
    shared-memory footprints small enough for 2-4 programs per SM (the 64-row tile with 3 stages of 64-key K/V tiles
    takes 112 KB, so earlier 2-split runs had one resident program per SM), merged in-kernel; two rounds."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    configs = [old, dict(old, num_splits=1, num_stages=2)] + [
        dict(old, num_splits=splits, block_n=n, num_stages=stages)
        for splits, n, stages in ((2, 64, 2), (2, 64, 3), (2, 32, 3), (2, 32, 4), (4, 32, 2), (4, 32, 3))]
    sweep_acceptance_case(generator, rows, "splits", [dict()], {5: configs, 4: configs}, rounds=2)


def sweep_warps(generator, rows):
    """Run 16: one program per pair with more warps issuing the gathers (8 warps; 128-key tiles), and the read-only
    gather with 8 warps at 1 and 2 programs per pair (is the single program's issue rate what limits it?)."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    configs = [old] + [dict(old, **kw) for kw in (dict(num_warps=8), dict(num_warps=8, block_n=128, num_stages=2),
                                                  dict(block_n=128, num_stages=2), dict(num_warps=8, num_stages=4))]
    sweep_acceptance_case(generator, rows, "warps", [dict()], {5: configs, 4: configs}, rounds=2)
    sweep_gather(generator, rows, variants=[(1, 3, 64, 4), (1, 3, 64, 8), (2, 3, 64, 4), (2, 3, 64, 8), (1, 3, 128, 8),
                                            (1, 2, 128, 8)])


def sweep_lean(generator, rows):
    """Run 17, three interleaved rounds: the kernel issued ~845 instructions per warp per 64-key tile at one warp per
    scheduler (ncu: 3 cycles per issued instruction, DRAM 34 % busy), so fewer instructions per tile is the lever.
    lean: no mask on tiles of 64 valid list items, K and V at one offset, the softmax scale folded into the exponent.
    Run 17 (bfd4637) also timed lazy rescaling (acc rescaled only when a row max grows by > 8 in log2 units; a
    block-wide max per tile): 0.6-1.3 us slower than lean alone, removed."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    lean = dict(old, lean=True)
    sweep_acceptance_case(generator, rows, "lean", [dict()], {5: [old, lean], 4: [old, lean]}, rounds=3)


def sweep_lean_tiles(generator, rows):
    """Run 18, three interleaved rounds: lean against the default with deeper pipelines and smaller key tiles, and at
    T=4 a 64-row (wgmma) tile, where run 17's lean gain came from (T=5), instead of the 32-row mma.sync one: that
    tile with lean is today's default (dict()); run 18 reached it with wide_tile, removed since (git ba29b41), and
    also timed it at 4 stages."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    lean = dict(old, lean=True)
    t5 = [old, lean, dict(lean, num_stages=4), dict(lean, block_n=32, num_stages=4), dict(lean, block_n=32,
                                                                                          num_stages=6)]
    sweep_acceptance_case(generator, rows, "leantiles", [dict()], {5: t5, 4: [old, lean, dict()]}, rounds=3)


def sweep_lean_rows(generator, rows):
    """Run 19, two interleaved rounds per target: the default (a 64-row wgmma tile with lean above 16 rows) against
    the smallest tile that holds the T * G rows (mma.sync, with new_separate at <= 32 rows) with and without lean, at
    Llama-3.1-8B (G=4), Qwen2.5-7B (G=7) and Qwen2.5-72B (G=8) heads."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    lean = dict(old, lean=True)
    for model in ("Llama-3.1-8B", "Qwen2.5-7B", "Qwen2.5-72B"):
        sweep_acceptance_case(generator, rows, "leanrows", [dict()], {4: [old, lean, dict()], 5: [old, lean, dict()]},
                              rounds=2, model=model)


def sweep_kv_pairs(generator, rows):
    """Run 13, three interleaved rounds at T=4 and T=5: the separate K and V caches against K and V side by side per
    position (one 512-byte row per gathered position for the sparse kernel; the full kernel reads the same bytes)."""
    old = SPARSE_DEFAULT_BEFORE_RUN_19
    sweep_acceptance_case(generator, rows, "kvpairs", [dict()], {4: [old], 5: [old, dict(old, new_separate=True)]},
                          rounds=3, layouts=(False, True))


SWEEPS = {  # --sweep-parts name -> grid(generator, rows)
    "sparse": sweep_sparse,
    "full": lambda generator, rows: sweep_full_splits(rows),
    "srh": lambda generator, rows: sweep_srh(rows),
    "draft": lambda generator, rows: sweep_draft_decode(rows),
    "pdl": sweep_pdl,
    "kvpairs": sweep_kv_pairs,
    "gather": sweep_gather,
    "splits": sweep_resident_splits,
    "warps": sweep_warps,
    "lean": sweep_lean,
    "leantiles": sweep_lean_tiles,
    "leanrows": sweep_lean_rows,
}
SWEEP_PARTS = tuple(SWEEPS)


def sweep(generator, parts=SWEEP_PARTS):
    """Launch-parameter grids on the acceptance shapes (kept in the results for the record), in SWEEPS order."""
    rows = []
    for name, grid in SWEEPS.items():
        if name in parts:
            grid(generator, rows)
    return rows


def git_sha() -> str:
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_tables(rows, estimators):
    print(f"\n{'model':13s} {'B':>3s} {'L':>6s} {'T':>2s} | {'full ms':>8s} {'TB/s':>5s} {'%ceil':>5s} | "
          f"{'sparse us':>9s} {'TB/s':>5s} {'speedup':>7s} | {'sdpa ms':>8s} {'x sdpa':>6s}")
    for r in rows:
        sdpa = f"{r['sdpa_ms']:8.3f} {r['full_speedup_vs_sdpa']:6.2f}" if r.get("sdpa_ms") else f"{'oom':>8s} {'':6s}"
        print(f"{r['model']:13s} {r['batch']:3d} {r['context']:6d} {r['tokens']:2d} | {r['full_ms']:8.3f} "
              f"{r['full_tbs']:5.2f} {100 * r['full_frac_of_copy_ceiling']:5.1f} | {r['sparse_ms'] * 1e3:9.1f} "
              f"{r['sparse_tbs']:5.2f} {r['sparse_speedup_vs_full']:7.1f} | {sdpa}")
    print(f"\n{'target + draft':28s} {'B':>3s} {'L':>6s} | {'estimator us':>12s} {'all-layer full ms':>17s} "
          f"{'fraction':>8s} | {'runtime':>8s} {'strict 2-pass':>13s}")
    for e in estimators:
        print(f"{e['target'] + ' + ' + e['draft']:28s} {e['batch']:3d} {e['context']:6d} | "
              f"{e['estimator_ms'] * 1e3:12.1f} {e['full_verify_all_layers_ms']:17.2f} "
              f"{100 * e['estimator_frac_of_full_verify']:7.3f}% | "
              f"{100 * e['estimator_runtime_frac_of_full_verify']:7.3f}% "
              f"{100 * e['estimator_strict_frac_of_full_verify']:12.3f}%")
    print("estimator: target without lse (one read of K, the SRH rows' scores kept), draft with lse from drafting;"
          "\nruntime: neither side has lse; strict 2-pass: the target re-reads K instead of keeping its score rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 16384, 32768, 65536])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4, 5])
    parser.add_argument("--k", type=int, default=512, help="sparse verification budget")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch parameters")
    parser.add_argument("--sweep-only", action="store_true", help="time the grid, skip the benchmark table")
    parser.add_argument("--sweep-parts", nargs="+", default=list(SWEEP_PARTS), choices=SWEEP_PARTS,
                        help="which grids --sweep / --sweep-only time")
    parser.add_argument("--out", default="benchmarks/results/attention_h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention: needs a CUDA device (run it on the H200 machine)")
    torch.manual_seed(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    sweep_rows = sweep(generator, args.sweep_parts) if args.sweep or args.sweep_only else []
    if args.sweep_only:
        args.models = []

    rows, estimators = [], []
    for name in args.models:
        shape = TARGETS[name]
        for batch in args.batches:
            for length in args.contexts:
                s_max = length + 16
                k_cache = torch.randn(batch, shape.heads_kv, s_max, shape.head_dim, device="cuda",
                                      dtype=torch.bfloat16)
                v_cache = torch.randn_like(k_cache)
                full_by_t = {}
                for t in args.tokens:
                    row = bench_case(shape, batch, length, t, args.k, k_cache, v_cache, generator, args.replays)
                    rows.append(row)
                    full_by_t[t] = row["full_ms"]
                    print(json.dumps(row), flush=True)
                for pair in PAIRS:
                    if pair.target == name and pair.gamma + 1 in full_by_t:
                        est = bench_estimator(pair, batch, length, k_cache, full_by_t[pair.gamma + 1], generator,
                                              args.replays)
                        estimators.append(est)
                        print(json.dumps(est), flush=True)
                del k_cache, v_cache
                torch.cuda.empty_cache()

    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "copy_ceiling_tbs": COPY_CEILING_TBS,
        "pdl_supported": pdl_supported(torch.device("cuda")), "kernels": json.loads(KERNELS.to_json()),
        "timing": "our ops: CUDA-graph replay, median over replays of (graph time / calls in graph); "
                  "sparse cycles 8 (q, indices) sets 4 times per graph; SDPA: eager, CUDA events, median",
        "pairs": [asdict(p) for p in PAIRS],
        "rows": rows, "estimator": estimators, "sweep": sweep_rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(rows, estimators)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
