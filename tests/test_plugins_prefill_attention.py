"""prefill_attention against a float64 reference: odd chunk lengths, per-sequence offsets, GQA groups, ragged
batches (query_lens), chunk boundaries, strided caches, fp8 caches, poisoned outputs and poisoned (never-read) cache
positions.

CPU: the Triton kernel under TRITON_INTERPRET=1 on small shapes (and small tiles); the full sweep needs CUDA.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_cuda, needs_kernel, use_interpreter  # noqa: E402

from trtllm_dustin.plugins import prefill_attention  # noqa: E402
from trtllm_dustin.plugins.kv_dtype import FP8_KV_DTYPE, to_cache_dtype  # noqa: E402
from trtllm_dustin.plugins.prefill_attention import prefill_attention_forward  # noqa: E402
from trtllm_dustin.plugins.reference import prefill_attention_ref  # noqa: E402


def reference(q, k_cache, v_cache, cache_seqlens, query_lens=None, softmax_scale=None):
    """float64 oracle (fp8 caches read as their float values)."""
    return prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens, query_lens,
                                 softmax_scale)


def make_cache(batch, heads_kv, s_max, head_dim, dtype, layout):
    if layout == "layer_view":  # one layer of a [n_layers, B, H_kv, S_max, D] buffer
        return to_cache_dtype(torch.randn(3, batch, heads_kv, s_max, head_dim, device=DEVICE), dtype)[1]
    if layout == "bshd":  # [B, S_max, H_kv, D] storage seen as [B, H_kv, S_max, D]
        return to_cache_dtype(torch.randn(batch, s_max, heads_kv, head_dim, device=DEVICE), dtype).transpose(1, 2)
    return to_cache_dtype(torch.randn(batch, heads_kv, s_max, head_dim, device=DEVICE), dtype)


def make_problem(offsets, t, query_lens, heads_kv, group, head_dim, dtype, cache_dtype=None, layout="contiguous"):
    """A chunk of T query tokens per sequence at offsets L_b, the first query_lens[b] of them real. Returns clean
    caches for the reference and copies whose positions >= L_b + q_len_b hold NaN (the kernel must not read them)."""
    batch = len(offsets)
    cache_dtype = cache_dtype or dtype
    s_max = max(offsets) + t + 5
    q = torch.randn(batch, t, heads_kv * group, head_dim, device=DEVICE).to(dtype)
    if layout == "bshd":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_clean = make_cache(batch, heads_kv, s_max, head_dim, cache_dtype, layout)
    v_clean = make_cache(batch, heads_kv, s_max, head_dim, cache_dtype, layout)
    k, v = k_clean.clone(), v_clean.clone()
    lens = query_lens if query_lens is not None else [t] * batch
    for b, (offset, n) in enumerate(zip(offsets, lens, strict=True)):
        k[b, :, offset + n:] = float("nan")
        v[b, :, offset + n:] = float("nan")
    seqlens = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    qlens = None if query_lens is None else torch.tensor(query_lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, k_clean, v_clean, seqlens, qlens


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten or NaN output elements"
    rel_tol, max_tol = TOLERANCE[dtype]
    err = (out.double() - ref).norm() / ref.norm()
    assert err < rel_tol, f"relative error {err:.2e} >= {rel_tol:.0e}"
    worst = (out.double() - ref).abs().max() / ref.abs().max()
    assert worst < max_tol, f"max error {worst:.2e} >= {max_tol:.0e}"


def check(offsets, t, query_lens, heads_kv, group, head_dim, dtype, cache_dtype=None, layout="contiguous", **launch):
    torch.manual_seed(sum(offsets) * 7 + t * 13 + group)
    q, k, v, k_clean, v_clean, seqlens, qlens = make_problem(offsets, t, query_lens, heads_kv, group, head_dim, dtype,
                                                             cache_dtype, layout)
    out = torch.full_like(q, float("nan"))
    if launch:
        prefill_attention_forward(q, k, v, seqlens, qlens, head_dim ** -0.5, out, **launch)
    else:
        assert prefill_attention(q, k, v, seqlens, qlens, out=out).data_ptr() == out.data_ptr()
    ref = reference(q, k_clean, v_clean, seqlens, qlens)
    assert_close(out, ref, dtype)
    if qlens is not None:  # padding rows are written as zeros
        for b, n in enumerate(query_lens):
            assert (out[b, n:] == 0).all()


# (offsets, T, query_lens): a first chunk (L = 0), later chunks at odd offsets, ragged and padding-only rows.
CPU_CASES = [
    ([0], 1, None),
    ([0, 0], 19, [19, 7]),
    ([5, 40, 0], 23, [23, 1, 11]),
    ([33, 0], 40, [40, 0]),
]


@needs_kernel
@pytest.mark.parametrize("offsets, t, query_lens", CPU_CASES)
@pytest.mark.parametrize("group, head_dim, dtype, layout", [
    (1, 64, torch.float32, "contiguous"),
    (3, 32, torch.bfloat16, "layer_view"),
    (4, 64, torch.float16, "bshd"),
])
def test_matches_reference(offsets, t, query_lens, group, head_dim, dtype, layout):
    check(offsets, t, query_lens, heads_kv=2, group=group, head_dim=head_dim, dtype=dtype, layout=layout)


@needs_kernel
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16)])
def test_tile_shapes_agree(block_m, block_n):
    """Tiles that put the causal diagonal across key blocks in different places give the same attention."""
    check([13, 3], 45, [45, 30], 1, 2, 32, torch.float32, block_m=block_m, block_n=block_n, num_warps=4,
          num_stages=2)


@needs_kernel
def test_fp8_cache():
    """A bf16 chunk over a float8_e4m3fn cache (the draft's fp8 cache) reads the cache's values."""
    check([9, 0], 21, [21, 5], 2, 3, 64, torch.bfloat16, cache_dtype=FP8_KV_DTYPE)


@needs_kernel
def test_chunks_equal_one_pass():
    """A prompt attended chunk by chunk (each chunk at its offset, the cache holding everything written so far) equals
    the whole prompt in one chunk: what runtime/prefill.py relies on."""
    torch.manual_seed(11)
    n, chunk, heads_kv, group, head_dim = 50, 16, 2, 2, 32
    q = torch.randn(2, n, heads_kv * group, head_dim, device=DEVICE)
    k = torch.randn(2, heads_kv, n + 3, head_dim, device=DEVICE)
    v = torch.randn(2, heads_kv, n + 3, head_dim, device=DEVICE)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    whole = prefill_attention(q, k, v, zero)
    parts = [prefill_attention(q[:, s:s + chunk], k, v, zero + s) for s in range(0, n, chunk)]
    assert_close(torch.cat(parts, dim=1), whole.double(), torch.float32)
    assert_close(whole, reference(q, k, v, zero), torch.float32)


def test_cpu_reference_path(monkeypatch):
    """Without the interpreter, CPU tensors take the reference (the CPU path of the triton backend)."""
    use_interpreter(monkeypatch, False)
    torch.manual_seed(5)
    q = torch.randn(2, 20, 4, 16)
    k, v = torch.randn(2, 2, 60, 16), torch.randn(2, 2, 60, 16)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    qlens = torch.tensor([20, 3], dtype=torch.int32)
    out = prefill_attention(q, k, v, seqlens, qlens)
    assert_close(out, reference(q, k, v, seqlens, qlens), torch.float32)
    assert (out[1, 3:] == 0).all()


@pytest.mark.parametrize("bad, message", [
    ("heads", "not a multiple"),
    ("dtype", "differs from q dtype"),
    ("seqlens", "cache_seqlens"),
    ("query_lens", "query_lens"),
    ("out", "out is"),
    ("head_dim", "head dim"),
])
def test_errors_name_the_problem(bad, message):
    q = torch.randn(2, 20, 8, 64)
    k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    seqlens = torch.tensor([10, 5], dtype=torch.int32)
    qlens, kwargs = None, {}
    if bad == "heads":
        q = torch.randn(2, 20, 5, 64)
    elif bad == "dtype":
        k = k.half()
    elif bad == "seqlens":
        seqlens = seqlens.long()
    elif bad == "query_lens":
        qlens = torch.tensor([20, 5, 1], dtype=torch.int32)
    elif bad == "out":
        kwargs["out"] = torch.empty(2, 20, 8, 32)
    elif bad == "head_dim":
        q, k, v = q[..., :48], k[..., :48], v[..., :48]
    with pytest.raises((ValueError, TypeError), match=message):
        prefill_attention(q, k, v, seqlens, qlens, **kwargs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("offsets, t, query_lens", [
    ([0], 1, None), ([0], 1000, None), ([0, 0, 0], 777, [777, 300, 1]), ([1000, 4097, 0], 513, [513, 129, 64]),
    ([2048, 0], 2048, [2048, 1999]), ([31, 3000], 2051, None),
])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "layer_view"])
def test_sweep_bf16_gpu(offsets, t, query_lens, group, head_dim, layout):
    check(offsets, t, query_lens, 2, group, head_dim, torch.bfloat16, layout=layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, None), (torch.float32, None),
                                                (torch.bfloat16, FP8_KV_DTYPE), (torch.float16, FP8_KV_DTYPE)])
def test_sweep_dtypes_gpu(dtype, cache_dtype):
    check([700, 0, 3], 1031, [1031, 1, 500], 2, 4, 128, dtype, cache_dtype=cache_dtype, layout="bshd")


@pytest.mark.gpu
@needs_cuda
def test_chunked_long_prompt_gpu():
    """8K tokens in 2K chunks against one pass, at Llama-3.1-8B's head shape (32 query heads over 8 KV heads)."""
    torch.manual_seed(2)
    n, chunk = 8192, 2048
    q = torch.randn(1, n, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    parts = torch.cat([prefill_attention(q[:, s:s + chunk], k, v, zero + s) for s in range(0, n, chunk)], dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True).transpose(1, 2)
    assert_close(parts, sdpa.double(), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    """The op is capturable: a replay on new inputs matches an eager call."""
    torch.manual_seed(7)
    q, k, v, _, _, seqlens, qlens = make_problem([100, 0], 300, [300, 150], 2, 4, 128, torch.bfloat16)
    k, v = k.nan_to_num(), v.nan_to_num()
    out = torch.empty_like(q)
    prefill_attention(q, k, v, seqlens, qlens, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill_attention(q, k, v, seqlens, qlens, out=out)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, prefill_attention(q, k, v, seqlens, qlens))

