"""srh_score against a direct float64 softmax: with lse from verify_attention, and without it (score
rows kept, and the variant that reads K twice); accumulation over layers, ragged batches, GQA
ratios, T, head dims. K of KV heads no selected head uses, and cache rows past L_b + T, hold NaN:
the kernel must not read them.

Invariant: S sums over the context to |heads| * T minus the probability mass on the new tokens.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.plugins import srh_score, verify_attention  # noqa: E402
from trtllm_dustin.plugins.reference import srh_score_ref  # noqa: E402
from trtllm_dustin.plugins.srh_score import srh_score_forward  # noqa: E402


def reference(q, k_cache, cache_seqlens, head_ids, softmax_scale=None):
    """float64 oracle: S [B, S_max], probabilities normalised over the causal range [0, L_b + t]."""
    return srh_score_ref(q.double(), k_cache.double(), cache_seqlens, head_ids, None, softmax_scale).double()


def new_token_mass(q, k_cache, cache_seqlens, head_ids):
    """float64: sum over heads and tokens of the probability on keys L_b .. L_b + t."""
    batch, t, heads_q, head_dim = q.shape
    group = heads_q // k_cache.shape[1]
    heads = list(head_ids)
    qs = q.double()[:, :, heads]
    ks = k_cache.double()[:, [h // group for h in heads]]
    scores = torch.einsum("btnd,bnsd->btns", qs, ks) / math.sqrt(head_dim)
    positions = torch.arange(k_cache.shape[2], device=q.device)
    lengths = cache_seqlens.long()[:, None, None, None]
    limit = lengths + torch.arange(t, device=q.device)[None, :, None, None]
    probs = torch.softmax(scores.masked_fill(positions > limit, float("-inf")), dim=-1)
    return (probs * (positions >= lengths)).sum(dim=(1, 2, 3))


REL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def make_problem(length, t, heads_kv, group, head_dim, dtype, head_ids):
    """Ragged batch; the kernel's K copy is NaN at rows >= L_b + T and in unused KV heads."""
    lengths = [length, length // 2, length // 3 + 1][: 3 if length > 1 else 2]
    batch, s_max = len(lengths), length + t + 5
    q = torch.randn(batch, t, heads_kv * group, head_dim, device=DEVICE).to(dtype)
    k_clean = torch.randn(3, batch, heads_kv, s_max, head_dim, device=DEVICE).to(dtype)[1]
    v = torch.randn(batch, heads_kv, s_max, head_dim, device=DEVICE).to(dtype)
    k_cache = k_clean.clone()
    used = {h // group for h in head_ids}
    for kv in range(heads_kv):
        if kv not in used:
            k_cache[:, kv] = float("nan")
    for b, length_b in enumerate(lengths):
        k_cache[b, :, length_b + t:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q, k_cache, k_clean, v, seqlens


def assert_close(scores, ref, dtype):
    assert torch.isfinite(scores).all(), "unwritten or NaN scores (or a read of an unused KV head)"
    err = (scores.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < REL_TOLERANCE[dtype], f"relative error {err:.2e}"


def check(length, t, heads_kv, group, head_dim, dtype, head_ids):
    torch.manual_seed(length + 5 * t + group)
    q, k_cache, k_clean, v, seqlens = make_problem(length, t, heads_kv, group, head_dim, dtype, head_ids)
    ref = reference(q, k_clean, seqlens, head_ids)
    two_pass = torch.full((q.shape[0], k_cache.shape[2]), float("nan"), device=DEVICE)
    srh_score(q, k_cache, seqlens, head_ids, out=two_pass)  # no lse: one read of K, score rows kept
    assert_close(two_pass, ref, dtype)
    recomputed = torch.full_like(two_pass, float("nan"))  # no lse, second read of K instead of score rows
    srh_score_forward(q, k_cache, seqlens, tuple(head_ids), None, 1 / math.sqrt(q.shape[-1]), recomputed, False,
                      raw_scores=False)
    assert_close(recomputed, ref, dtype)
    _, lse = verify_attention(q, k_clean, v, seqlens, return_lse=True)
    one_pass = torch.full_like(two_pass, float("nan"))
    srh_score(q, k_cache, seqlens, head_ids, lse=lse, out=one_pass)
    assert_close(one_pass, ref, dtype)
    # Context only: exact zeros from L_b on; the mass adds up with the new tokens' share.
    positions = torch.arange(k_cache.shape[2], device=DEVICE)[None, :]
    assert (two_pass[positions >= seqlens[:, None]] == 0).all()
    assert (two_pass >= 0).all()
    total = two_pass.double().sum(1) + new_token_mass(q, k_clean, seqlens, head_ids)
    assert torch.allclose(total, torch.full_like(total, len(head_ids) * t), rtol=1e-4)


# (group, T, head_dim, dtype, heads): G 1/3/4/7, T 1..5, D 64/128, heads sharing / not sharing a KV head.
CPU_SHAPES = [
    (1, 1, 64, torch.float32, (0,)),
    (3, 2, 128, torch.bfloat16, (0, 2, 4)),
    (4, 3, 64, torch.float16, (1, 2, 3, 4)),
    (7, 4, 128, torch.bfloat16, (13, 6)),
    (4, 5, 64, torch.bfloat16, (7, 0, 5, 2)),
]


@needs_kernel
@pytest.mark.parametrize("length", [1, 7, 1000, 2049])  # the GPU sweep below also runs 4097
@pytest.mark.parametrize("group, t, head_dim, dtype, head_ids", CPU_SHAPES)
def test_matches_reference(length, group, t, head_dim, dtype, head_ids):
    check(length, t, 2, group, head_dim, dtype, head_ids)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sweep_gpu(length, group, t, head_dim, dtype):
    heads_q = 8 * group
    head_ids = tuple(sorted({0, heads_q // 3, heads_q // 2 + 1, heads_q - 1}))
    check(length, t, 8, group, head_dim, dtype, head_ids)


@pytest.mark.gpu
@needs_cuda
def test_more_than_eight_kv_groups_gpu():
    """Heads spread over 12 KV heads take two launches, the second accumulating."""
    check(1000, 2, 16, 2, 64, torch.bfloat16, tuple(range(0, 24, 2)))


@needs_kernel
def test_accumulate_sums_layers():
    """accumulate=True adds into out, so several layers sum into one S."""
    torch.manual_seed(21)
    layers = [make_problem(500, 3, 2, 4, 64, torch.float32, (1, 6)) for _ in range(2)]
    total = torch.rand(layers[0][0].shape[0], layers[0][1].shape[2], device=DEVICE)
    expected = total.double().clone()
    for q, k_cache, k_clean, _, seqlens in layers:
        srh_score(q, k_cache, seqlens, (1, 6), out=total, accumulate=True)
        expected += reference(q, k_clean, seqlens, (1, 6))
    assert (total.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("kwargs, message", [
    ({"head_ids": (0, 0)}, "distinct"),
    ({"head_ids": (8,)}, "distinct"),
    ({"accumulate": True}, "needs out="),
    ({"lse": torch.zeros(2, 2, 3)}, "lse is"),
])
def test_errors_name_the_problem(kwargs, message):
    q = torch.randn(2, 2, 8, 64)
    k = torch.randn(2, 2, 40, 64)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    head_ids = kwargs.pop("head_ids", (1,))
    with pytest.raises(ValueError, match=message):
        srh_score(q, k, seqlens, head_ids, **kwargs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    torch.manual_seed(23)
    q, k_cache, k_clean, v, seqlens = make_problem(3000, 4, 2, 7, 64, torch.bfloat16, (0, 3, 9, 13))
    _, lse = verify_attention(q, k_clean, v, seqlens, return_lse=True)
    out = torch.empty(q.shape[0], k_cache.shape[2], device=DEVICE)
    for given in (lse, None):
        srh_score(q, k_clean, seqlens, (0, 3, 9, 13), lse=given, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            srh_score(q, k_clean, seqlens, (0, 3, 9, 13), lse=given, out=out)
        q.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, srh_score(q, k_clean, seqlens, (0, 3, 9, 13), lse=given))


def test_opcheck():
    torch.manual_seed(25)
    q = torch.randn(2, 2, 4, 16, device=DEVICE)
    k = torch.randn(2, 2, 40, 16, device=DEVICE)
    seqlens = torch.tensor([30, 5], dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 40, device=DEVICE)
    torch.library.opcheck(torch.ops.trtllm_dustin.srh_score.default,
                          (q, k, seqlens, [1, 3], None, 0.25, out, False, False),
                          test_utils=("test_schema", "test_faketensor"))
