"""verify_attention against a float64 reference: odd lengths, GQA ratios, T, head dims, ragged
batches, strided caches, poisoned outputs and poisoned (never-read) cache positions.

CPU: runs the Triton kernel under TRITON_INTERPRET=1 on a small sweep; the full sweep needs CUDA.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.plugins import verify_attention  # noqa: E402
from trtllm_dustin.plugins.reference import verify_attention_ref  # noqa: E402


def reference(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """float64 oracle: out [B, T, H_q, D], lse [B, T, H_q]."""
    return verify_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens, softmax_scale,
                                return_lse=True)


LSE_TOLERANCE = 1e-4


def make_cache(batch, heads_kv, s_max, head_dim, dtype, layout):
    """A [B, H_kv, S_max, D] cache with random values, as a strided view like the model uses."""
    if layout == "layer_view":  # one layer of a [n_layers, B, H_kv, S_max, D] buffer
        return torch.randn(3, batch, heads_kv, s_max, head_dim, device=DEVICE).to(dtype)[1]
    if layout == "bshd":  # [B, S_max, H_kv, D] storage seen as [B, H_kv, S_max, D]
        return torch.randn(batch, s_max, heads_kv, head_dim, device=DEVICE).to(dtype).transpose(1, 2)
    return torch.randn(batch, heads_kv, s_max, head_dim, device=DEVICE).to(dtype)


def make_problem(length, t, heads_kv, group, head_dim, dtype, layout="contiguous"):
    """Ragged batch (lengths L, L // 2, L // 3 + 1): clean caches for the reference, and copies
    whose positions >= L_b + T hold NaN, which the kernel must never read."""
    lengths = [length, length // 2, length // 3 + 1][: 3 if length > 1 else 2]
    batch = len(lengths)
    s_max = length + t + 5
    q = torch.randn(batch, t, heads_kv * group, head_dim, device=DEVICE).to(dtype)
    if layout == "bshd":  # q as a [B, H, T, D] tensor seen as [B, T, H, D]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_clean = make_cache(batch, heads_kv, s_max, head_dim, dtype, layout)
    v_clean = make_cache(batch, heads_kv, s_max, head_dim, dtype, layout)
    k, v = k_clean.clone(), v_clean.clone()
    for b, length_b in enumerate(lengths):
        k[b, :, length_b + t:] = float("nan")
        v[b, :, length_b + t:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q, k, v, k_clean, v_clean, seqlens


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten or NaN output elements"
    rel_tol, max_tol = TOLERANCE[dtype]
    err = (out.double() - ref).norm() / ref.norm()
    assert err < rel_tol, f"relative error {err:.2e} >= {rel_tol:.0e}"
    worst = (out.double() - ref).abs().max() / ref.abs().max()
    assert worst < max_tol, f"max error {worst:.2e} >= {max_tol:.0e}"


def check(length, t, heads_kv, group, head_dim, dtype, layout="contiguous"):
    torch.manual_seed(length * 131 + t * 17 + group)
    q, k, v, k_clean, v_clean, seqlens = make_problem(length, t, heads_kv, group, head_dim, dtype, layout)
    out = torch.full_like(q, float("nan"))
    result, lse = verify_attention(q, k, v, seqlens, out=out, return_lse=True)
    assert result.data_ptr() == out.data_ptr()
    ref, ref_lse = reference(q, k_clean, v_clean, seqlens)
    assert_close(out, ref, dtype)
    assert torch.isfinite(lse).all()
    assert (lse.double() - ref_lse).abs().max() < LSE_TOLERANCE * max(1.0, ref_lse.abs().max().item())


# (group, T, head_dim, dtype, layout): together they cover G 1/3/4/7, T 1..5, D 64/128, all dtypes.
CPU_SHAPES = [
    (1, 1, 64, torch.float32, "contiguous"),
    (3, 2, 128, torch.bfloat16, "layer_view"),
    (4, 3, 64, torch.float16, "bshd"),
    (7, 4, 128, torch.bfloat16, "contiguous"),
    (4, 5, 64, torch.bfloat16, "layer_view"),
    (4, 8, 64, torch.bfloat16, "contiguous"),  # a Γ = 7 round (LongSpark's blocks)
]


@needs_kernel
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group, t, head_dim, dtype, layout", CPU_SHAPES)
def test_matches_reference(length, group, t, head_dim, dtype, layout):
    check(length, t, heads_kv=2, group=group, head_dim=head_dim, dtype=dtype, layout=layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "layer_view"])
@pytest.mark.parametrize("heads_kv", [1, 8])
def test_sweep_bf16_gpu(length, group, t, head_dim, layout, heads_kv):
    check(length, t, heads_kv, group, head_dim, torch.bfloat16, layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sweep_dtypes_gpu(length, group, dtype):
    check(length, 3, 2, group, 128, dtype, "bshd")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group, t", [(8, 16), (7, 16), (1, 16)])
def test_many_query_tokens_gpu(group, t):
    check(3000, t, 2, group, 128, torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_counts_agree(num_splits):
    """Every split count gives the same attention (the combine step is exact up to rounding)."""
    from trtllm_dustin.plugins.verify_attention import verify_attention_forward

    torch.manual_seed(num_splits)
    q, k, v, k_clean, v_clean, seqlens = make_problem(700, 3, 2, 4, 64, torch.float32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    verify_attention_forward(q, k, v, seqlens, 1 / 8, out, lse, num_splits=num_splits)
    ref, ref_lse = reference(q, k_clean, v_clean, seqlens, 1 / 8)
    assert_close(out, ref, torch.float32)
    assert (lse.double() - ref_lse).abs().max() < LSE_TOLERANCE


@needs_kernel
def test_softmax_scale_and_decode_step():
    """T = 1 is the vanilla decoder; a custom scale is honoured."""
    torch.manual_seed(3)
    q, k, v, k_clean, v_clean, seqlens = make_problem(300, 1, 2, 3, 64, torch.float32)
    out = verify_attention(q, k, v, seqlens, softmax_scale=0.3)
    ref, _ = reference(q, k_clean, v_clean, seqlens, 0.3)
    assert_close(out, ref, torch.float32)
    assert not math.isclose(0.3, 1 / math.sqrt(64))


def test_cpu_reference_path():
    """On CPU tensors the op gives the reference's answer (the kernel under the interpreter)."""
    torch.manual_seed(5)
    q = torch.randn(2, 2, 4, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    out = verify_attention(q, k, v, seqlens)
    ref, _ = reference(q, k, v, seqlens)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("bad, message", [
    ("heads", "not a multiple"),
    ("dtype", "differs from q dtype"),
    ("tokens", "query tokens"),
    ("seqlens", "cache_seqlens"),
    ("out", "out is"),
])
def test_errors_name_the_problem(bad, message):
    q = torch.randn(2, 2, 8, 64)
    k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    kwargs = {}
    if bad == "heads":
        q = torch.randn(2, 2, 5, 64)
    elif bad == "dtype":
        k = k.half()
    elif bad == "tokens":
        q = torch.randn(2, 17, 8, 64)
    elif bad == "seqlens":
        seqlens = seqlens.long()
    elif bad == "out":
        kwargs["out"] = torch.empty(2, 2, 8, 32)
    with pytest.raises((ValueError, TypeError), match=message):
        verify_attention(q, k, v, seqlens, **kwargs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    """The op is capturable: replaying the graph on new inputs matches eager calls."""
    torch.manual_seed(7)
    q, k, v, _, _, seqlens = make_problem(2000, 4, 8, 4, 128, torch.bfloat16)
    k, v = k.nan_to_num(), v.nan_to_num()
    out = torch.empty_like(q)
    verify_attention(q, k, v, seqlens, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(q, k, v, seqlens, out=out)
    q.copy_(torch.randn_like(q))
    seqlens.copy_(torch.tensor([1500, 30, 999], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, verify_attention(q, k, v, seqlens))


def test_opcheck():
    """Schema, fake impl and mutation annotations of the registered op are consistent."""
    torch.manual_seed(9)
    q = torch.randn(2, 2, 4, 16, device=DEVICE)
    k, v = torch.randn(2, 2, 40, 16, device=DEVICE), torch.randn(2, 2, 40, 16, device=DEVICE)
    seqlens = torch.tensor([30, 5], dtype=torch.int32, device=DEVICE)
    out, lse = torch.empty_like(q), torch.empty(2, 2, 4, device=DEVICE)
    torch.library.opcheck(torch.ops.trtllm_dustin.verify_attention.default,
                          (q, k, v, seqlens, 0.25, 0, out, lse, False),
                          test_utils=("test_schema", "test_faketensor"))
