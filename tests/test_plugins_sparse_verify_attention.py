"""sparse_verify_attention against a float64 reference: shuffled and padded index lists, K > L,
ragged batches, GQA ratios, T, head dims; unselected cache rows hold NaN so any stray read shows.
Invariant: selecting all of [0, L_b) reproduces full-cache verify_attention.

CPU: runs the Triton kernel under TRITON_INTERPRET=1 on a small sweep; the full sweep needs CUDA.
"""


import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.plugins import sparse_verify_attention, verify_attention  # noqa: E402
from trtllm_dustin.plugins.reference import sparse_verify_attention_ref  # noqa: E402


def reference(q, k_cache, v_cache, cache_seqlens, indices, softmax_scale=None):
    """float64 oracle: out [B, T, H_q, D]."""
    return sparse_verify_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens, indices,
                                       softmax_scale)




def make_indices(lengths, k, order):
    """int32 [B, K]: min(K, L_b) distinct positions of [0, L_b), then -1.

    order "sorted" is what selection produces; "shuffled" permutes the valid entries; "scattered"
    also mixes the padding in between them.
    """
    rows = []
    for length in lengths:
        chosen = torch.randperm(length)[: min(k, length)]
        if order == "sorted":
            chosen = chosen.sort().values
        row = torch.cat([chosen, torch.full((k - len(chosen),), -1, dtype=torch.long)])
        if order == "scattered":
            row = row[torch.randperm(k)]
        rows.append(row)
    return torch.stack(rows).to(torch.int32).to(DEVICE)


def make_problem(length, t, heads_kv, group, head_dim, dtype, k, order):
    """Ragged batch; the kernel's copy of the cache holds NaN everywhere it must not read."""
    lengths = [length, length // 2, length // 3 + 1][: 3 if length > 1 else 2]
    batch, s_max = len(lengths), length + t + 5
    q = torch.randn(batch, t, heads_kv * group, head_dim, device=DEVICE).to(dtype)
    k_clean = torch.randn(3, batch, heads_kv, s_max, head_dim, device=DEVICE).to(dtype)[1]
    v_clean = torch.randn(batch, s_max, heads_kv, head_dim, device=DEVICE).to(dtype).transpose(1, 2)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    indices = make_indices(lengths, k, order)
    read = torch.zeros(batch, s_max + 1, dtype=torch.bool, device=DEVICE)
    read.scatter_(1, torch.where(indices >= 0, indices.long(), s_max), True)
    for b, length_b in enumerate(lengths):
        read[b, length_b:length_b + t] = True
    unread = ~read[:, None, :s_max, None]
    k_cache = k_clean.masked_fill(unread, float("nan"))
    v_cache = v_clean.masked_fill(unread, float("nan"))
    return q, k_cache, v_cache, k_clean, v_clean, seqlens, indices


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten or NaN output elements (or a stray read of an unselected row)"
    rel_tol, max_tol = TOLERANCE[dtype]
    err = (out.double() - ref).norm() / ref.norm()
    assert err < rel_tol, f"relative error {err:.2e} >= {rel_tol:.0e}"
    worst = (out.double() - ref).abs().max() / ref.abs().max()
    assert worst < max_tol, f"max error {worst:.2e} >= {max_tol:.0e}"


def check(length, t, heads_kv, group, head_dim, dtype, k, order):
    torch.manual_seed(length * 7 + t * 3 + group + k)
    q, k_cache, v_cache, k_clean, v_clean, seqlens, indices = make_problem(
        length, t, heads_kv, group, head_dim, dtype, k, order)
    out = torch.full_like(q, float("nan"))
    result = sparse_verify_attention(q, k_cache, v_cache, seqlens, indices, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference(q, k_clean, v_clean, seqlens, indices), dtype)


# (group, T, head_dim, dtype, K, order): G 1/3/4/7, T 1..6 and 8, D 64/128, all dtypes, K < L and K > L.
CPU_SHAPES = [
    (1, 1, 64, torch.float32, 64, "sorted"),
    (3, 2, 128, torch.bfloat16, 300, "shuffled"),
    (4, 3, 64, torch.float16, 17, "scattered"),
    (7, 4, 128, torch.bfloat16, 512, "sorted"),
    (4, 5, 64, torch.bfloat16, 1200, "scattered"),
    (3, 6, 128, torch.bfloat16, 300, "shuffled"),  # Γ = 5 and Γ = 7 rounds (LongSpark's blocks)
    (4, 8, 64, torch.bfloat16, 512, "sorted"),
]


@needs_kernel
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group, t, head_dim, dtype, k, order", CPU_SHAPES)
def test_matches_reference(length, group, t, head_dim, dtype, k, order):
    check(length, t, 2, group, head_dim, dtype, k, order)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k", [5, 512, 4096])
def test_sweep_bf16_gpu(length, group, t, head_dim, k):
    check(length, t, 8, group, head_dim, torch.bfloat16, k, "scattered" if k == 5 else "sorted")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length", [1, 7, 1000, 4097])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sweep_dtypes_gpu(length, group, dtype):
    check(length, 3, 2, group, 128, dtype, 512, "shuffled")


@needs_kernel
@pytest.mark.parametrize("length, t, group", [(7, 1, 1), (1000, 3, 4), (300, 5, 7)])
def test_all_indices_equal_full_attention(length, t, group):
    """k >= context makes sparse verification exact: I = [0, L_b) gives verify_attention's output."""
    torch.manual_seed(length + t)
    lengths = [length, length // 2]
    s_max = length + t
    q = torch.randn(2, t, 2 * group, 64, device=DEVICE)
    k_cache, v_cache = torch.randn(2, 2, s_max, 64, device=DEVICE), torch.randn(2, 2, s_max, 64, device=DEVICE)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    positions = torch.arange(length + 3, dtype=torch.int32, device=DEVICE)[None, :]
    indices = torch.where(positions < seqlens[:, None], positions, -1)
    sparse = sparse_verify_attention(q, k_cache, v_cache, seqlens, indices)
    full = verify_attention(q, k_cache, v_cache, seqlens)
    assert ((sparse - full).norm() / full.norm()) < 1e-5


@needs_kernel
@pytest.mark.parametrize("num_splits, block_m, new_separate",
                         [(1, 16, False), (2, 32, False), (7, 64, False), (7, 16, False), (3, 16, False),
                          (1, 64, True), (2, 32, True), (3, 16, True), (7, 64, True)])
def test_launch_configs_agree(num_splits, block_m, new_separate):
    """Key splits (merged in-kernel), query-row blocks and folding the new tokens in after the walk change the
    schedule, not the result; the in-kernel merge leaves its arrival counters at zero for the next launch."""
    from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward, split_counters

    torch.manual_seed(num_splits)
    q, k_cache, v_cache, k_clean, v_clean, seqlens, indices = make_problem(
        900, 4, 2, 4, 64, torch.float32, 400, "scattered")
    expected = reference(q, k_clean, v_clean, seqlens, indices, 0.125)
    lse_one = torch.empty(q.shape[:3], device=DEVICE)
    sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, torch.empty_like(q), lse_one,
                                    num_splits=1)
    for _ in range(2):  # the second launch reuses the counters the first one left behind
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
        sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, out, lse,
                                        num_splits=num_splits, block_m=block_m, new_separate=new_separate)
        assert_close(out, expected, torch.float32)
        torch.testing.assert_close(lse, lse_one, rtol=1e-5, atol=1e-5)  # the merged log-sum-exp, same as one pass
    if num_splits > 1:
        assert int(split_counters(q.device, 1).abs().sum()) == 0


@needs_kernel
@pytest.mark.parametrize("new_separate", [False, True])
def test_the_64_row_tile_masks_the_rows_past_t_times_g(new_separate):
    """Above 16 query rows the default tile has 64 rows, more than T * G = 20 here: the 44 padding rows are masked,
    the result is unchanged."""
    from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward

    torch.manual_seed(21)
    q, k_cache, v_cache, k_clean, v_clean, seqlens, indices = make_problem(
        700, 5, 2, 4, 64, torch.float32, 300, "scattered")
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, out, lse, num_splits=1,
                                    new_separate=new_separate)
    assert_close(out, reference(q, k_clean, v_clean, seqlens, indices, 0.125), torch.float32)
    assert torch.isfinite(lse).all()


@needs_kernel
@pytest.mark.parametrize("new_separate", [False, True])
@pytest.mark.parametrize("order, t, num_splits, spread", [("sorted", 5, 1, 1.0), ("scattered", 5, 1, 1.0),
                                                          ("sorted", 1, 3, 1.0), ("shuffled", 4, 2, 1.0),
                                                          ("sorted", 5, 1, 12.0), ("scattered", 3, 2, 12.0)])
def test_lean_tiles_agree(new_separate, order, t, num_splits, spread):
    """lean: tiles of valid list items only take no mask, the others the full one, the scale sits in the exponent.
    With padding at the end (sorted, what selection gives) or mixed in (scattered), one or several splits, the new
    tokens in the walk or folded in after it, and queries scaled by `spread` (large jumps of the running max), output
    and log-sum-exp equal the reference and the launch without lean."""
    from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward

    torch.manual_seed(t * 7 + num_splits)
    q, k_cache, v_cache, k_clean, v_clean, seqlens, indices = make_problem(
        600, t, 2, 4, 64, torch.float32, 250, order)  # 250 > 201: the third sequence pads
    q = q * spread
    lse_plain = torch.empty(q.shape[:3], device=DEVICE)
    sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, torch.empty_like(q), lse_plain,
                                    num_splits=1, lean=False)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, out, lse, num_splits=num_splits,
                                    block_n=16, lean=True, new_separate=new_separate)
    assert_close(out, reference(q, k_clean, v_clean, seqlens, indices, 0.125), torch.float32)
    torch.testing.assert_close(lse, lse_plain, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bad, message", [("dtype", "int32"), ("rows", r"\[2, K\]")])
def test_errors_name_the_problem(bad, message):
    q = torch.randn(2, 2, 8, 64)
    k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    indices = torch.zeros(2, 8, dtype=torch.int32)
    if bad == "dtype":
        indices = indices.long()
    else:
        indices = indices[:1]
    with pytest.raises(ValueError, match=message):
        sparse_verify_attention(q, k, v, seqlens, indices)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    """The op is capturable: replaying the graph on new indices matches eager calls."""
    torch.manual_seed(11)
    q, k_cache, v_cache, _, _, seqlens, indices = make_problem(3000, 5, 8, 8, 128, torch.bfloat16, 512, "sorted")
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    out = torch.empty_like(q)
    sparse_verify_attention(q, k_cache, v_cache, seqlens, indices, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_verify_attention(q, k_cache, v_cache, seqlens, indices, out=out)
    indices.copy_(make_indices(seqlens.tolist(), 512, "shuffled"))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sparse_verify_attention(q, k_cache, v_cache, seqlens, indices))


def test_opcheck():
    torch.manual_seed(13)
    q = torch.randn(2, 2, 4, 16, device=DEVICE)
    k, v = torch.randn(2, 2, 40, 16, device=DEVICE), torch.randn(2, 2, 40, 16, device=DEVICE)
    seqlens = torch.tensor([30, 5], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor([[0, 3, 9, -1], [4, 1, -1, -1]], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.trtllm_dustin.sparse_verify_attention.default,
                          (q, k, v, seqlens, indices, 0.25, torch.empty_like(q), False),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
@pytest.mark.parametrize("k, t, num_splits", [(0, 1, 1), (0, 5, 1), (1, 3, 1), (64, 5, 1), (65, 2, 2), (130, 4, 3)])
def test_new_tokens_folded_in_after_the_walk(k, t, num_splits):
    """new_separate: the K/V of the T new tokens are gathered before the index walk and folded in after it (by the
    last split); empty lists (k = 0: only the new tokens), lists of one tile plus one and several splits agree with
    the reference, and no padding or unselected row is read (the caches hold NaN there)."""
    from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward

    torch.manual_seed(k * 11 + t)
    q, k_cache, v_cache, k_clean, v_clean, seqlens, indices = make_problem(300, t, 2, 3, 64, torch.float32, k,
                                                                           "scattered")
    expected = reference(q, k_clean, v_clean, seqlens, indices, 0.125)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEVICE)
    sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, 0.125, out, lse, num_splits=num_splits,
                                    new_separate=True)
    assert_close(out, expected, torch.float32)
    assert torch.isfinite(lse).all()
