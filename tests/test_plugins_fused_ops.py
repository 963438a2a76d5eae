"""Fused decoder-layer ops against the decoder's own torch code (bit for bit, up to a rare last-ulp flip) and a
float64 oracle: odd widths, T 1..5, ragged and scattered cache positions, strided views, poisoned buffers,
caches untouched outside the addressed positions, error messages, op registration.

CPU: runs the Triton kernels under TRITON_INTERPRET=1; the same tests run on CUDA tensors when a GPU is present.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from helpers.kernels import DEVICE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.models.decoder import RMSNorm  # noqa: E402
from trtllm_dustin.models.rope import apply_rope  # noqa: E402
from trtllm_dustin.plugins.fused_ops import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_forward,
    add_rms_norm_ref,
    rope_qkv_to_cache,
    rope_qkv_to_cache_forward,
    rope_qkv_to_cache_ref,
    silu_mul,
    silu_mul_forward,
    silu_mul_ref,
)

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MIN_NORMAL_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}
# How far from torch's own result an op may land: (most ulps for any element, share that must match bit for
# bit). In 16-bit dtypes the last fp32 bits of a reduction order, rsqrt or exp flip a rounding now and then
# (see fused_ops' docstring); in fp32 those last bits are the output itself, so some ulps and no bit-exact share:
# on the GPU both sides use approximate exp and division (about 2 ulp each), which compound through
# x * sigmoid(x) * up; the H200 showed 9 ulp at inter = 14336 (the float64 check below still bounds the error).
TORCH_MATCH = {torch.bfloat16: (1, 0.99), torch.float16: (1, 0.99), torch.float32: (16, 0.0)}
# |out - ref| / |ref| against float64: half an ulp per rounding the torch code does, two roundings at most.
F64_RTOL = {torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


def spacing(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between adjacent `dtype` values at |t| (float64; subnormals get the smallest normal's gap)."""
    _, exponent = torch.frexp(t.double().abs())
    exponent = torch.clamp(exponent - 1, min=MIN_NORMAL_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), exponent - MANTISSA_BITS[dtype])


def assert_torch_exact(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 / fp16: out equals torch's result bit for bit on >= 99% of the elements and within one ulp everywhere."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN output elements"
    max_ulp, min_exact = TORCH_MATCH[out.dtype]
    diff = (out.double() - ref.double()).abs()
    gap = spacing(torch.maximum(out.double().abs(), ref.double().abs()), out.dtype)
    worst = (diff / gap).max().item()
    assert worst <= max_ulp, f"an element is {worst:.2f} ulp away from torch's result (at most {max_ulp})"
    exact = (out == ref).double().mean().item()
    assert exact >= min_exact, f"only {exact:.2%} of the elements match torch bit for bit (at least {min_exact:.0%})"


def assert_f64_close(out: torch.Tensor, ref64: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(out.double(), ref64, rtol=F64_RTOL[out.dtype], atol=atol)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# add_rms_norm

EPS = 1e-5


def rms_norm_f64(summed, weight, eps=EPS):
    s = summed.double()
    return weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("cols", [576, 2048, 3584, 4096, 8192, 999])
def test_add_rms_norm_matches_decoder(cols, with_delta, dtype):
    torch.manual_seed(cols + with_delta)
    x = randn(2, 3, cols, dtype=dtype, scale=4.0)
    delta = randn(2, 3, cols, dtype=dtype) if with_delta else None
    weight = randn(cols, dtype=dtype, scale=0.5) + 1
    normed, summed = add_rms_norm(x, delta, weight, EPS)

    if with_delta:
        assert torch.equal(bits(summed), bits(x + delta))
    else:
        assert summed is x
    norm = RMSNorm(cols, EPS).to(device=DEVICE, dtype=dtype)  # the module the op replaces
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        expected = norm(x if delta is None else x + delta)
    assert_torch_exact(normed, expected)
    assert_torch_exact(normed, add_rms_norm_ref(x, delta, weight, EPS)[0])
    assert_f64_close(normed, rms_norm_f64(summed, weight))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_writes_every_element_of_strided_rows(dtype):
    """Rows that are slices of wider buffers, poisoned outputs with a gap between rows that stays untouched."""
    torch.manual_seed(1)
    rows, cols = 5, 1000
    x = randn(rows, cols + 24, dtype=dtype)[:, :cols]
    delta = randn(rows, cols + 8, dtype=dtype)[:, 8:]
    weight = randn(cols, dtype=dtype) + 1
    normed_buf = torch.full((rows, cols + 3), float("nan"), device=DEVICE, dtype=dtype)
    summed_buf = torch.full((rows, cols + 3), float("nan"), device=DEVICE, dtype=dtype)
    add_rms_norm_forward(x, delta, weight, EPS, normed_buf[:, :cols], summed_buf[:, :cols])
    ref_normed, ref_summed = add_rms_norm_ref(x, delta, weight, EPS)
    assert_torch_exact(normed_buf[:, :cols], ref_normed)
    assert torch.equal(bits(summed_buf[:, :cols]), bits(ref_summed))
    assert normed_buf[:, cols:].isnan().all() and summed_buf[:, cols:].isnan().all()


@needs_kernel
def test_add_rms_norm_single_row_and_eps():
    """A 1-D input and the largest width; eps reaches the kernel (a near-zero row is dominated by it)."""
    torch.manual_seed(2)
    cols = 16384
    x = randn(cols, dtype=torch.float32, scale=1e-3)
    weight = randn(cols, dtype=torch.float32)
    for eps in (1e-6, 1e-2):
        normed, _ = add_rms_norm(x, None, weight, eps)
        assert_f64_close(normed, rms_norm_f64(x, weight, eps))


# ----------------------------------------------------------------------------------------------------------
# rope_qkv_to_cache

LAYERS = 3  # the cache under test is layer 1 of a [LAYERS, B, H_kv, S_max, D] buffer


def rope_tables(positions, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()  # [B, T, D/2]


def make_positions(batch, t, s_max, layout):
    """Ragged decode positions L_b + t (L_b = 0, mid, end of cache) or scattered distinct positions."""
    if layout == "scattered":
        return torch.stack([torch.randperm(s_max, device=DEVICE)[:t] for _ in range(batch)])
    starts = torch.tensor([(0, s_max // 2 + 1, s_max - t)[b % 3] for b in range(batch)], device=DEVICE)
    return starts[:, None] + torch.arange(t, device=DEVICE)


def make_qkv(batch, t, width, dtype, layout):
    if layout == "contiguous":
        return randn(batch, t, width, dtype=dtype)
    if layout == "time_major":  # [T, B, W] storage seen as [B, T, W]
        return randn(t, batch, width, dtype=dtype).transpose(0, 1)
    return randn(batch, t, width + 40, dtype=dtype)[..., 24:24 + width]  # rows of a wider buffer


def check_rope(batch, t, heads_q, heads_kv, head_dim, dtype, qkv_layout, cache_layout, position_layout,
               position_dtype=torch.int64):
    torch.manual_seed(heads_q * 7 + t)
    s_max = 23
    qkv = make_qkv(batch, t, (heads_q + 2 * heads_kv) * head_dim, dtype, qkv_layout)
    positions = make_positions(batch, t, s_max, position_layout)
    cos, sin = rope_tables(positions, head_dim)
    shape = (LAYERS, batch, heads_kv, s_max, head_dim)
    if cache_layout == "bshd":  # [L, B, S, H, D] storage seen as [L, B, H, S, D]
        k_buf = randn(LAYERS, batch, s_max, heads_kv, head_dim, dtype=dtype).transpose(2, 3)
        v_buf = randn(LAYERS, batch, s_max, heads_kv, head_dim, dtype=dtype).transpose(2, 3)
    else:
        k_buf, v_buf = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    k_expected, v_expected = k_buf.clone(), v_buf.clone()
    q_expected = rope_qkv_to_cache_ref(qkv, cos, sin, k_expected[1], v_expected[1], positions, heads_q, heads_kv,
                                       head_dim)
    written = torch.zeros(shape, dtype=torch.bool, device=DEVICE)
    written[1][torch.arange(batch, device=DEVICE)[:, None], :, positions] = True
    k_buf[written] = float("nan")  # the op must overwrite every addressed slot
    v_buf[written] = float("nan")

    q = rope_qkv_to_cache(qkv, cos, sin, k_buf[1], v_buf[1], positions.to(position_dtype), heads_q, heads_kv,
                          head_dim)

    assert q.shape == (batch, t, heads_q, head_dim) and q.is_contiguous()
    assert_torch_exact(q, q_expected)
    assert torch.equal(bits(k_buf[~written]), bits(k_expected[~written])), "k written outside the positions"
    assert torch.equal(bits(v_buf[~written]), bits(v_expected[~written])), "v written outside the positions"
    assert torch.equal(bits(v_buf[written]), bits(v_expected[written])), "v must be copied unchanged"
    assert_torch_exact(k_buf[written], k_expected[written])

    # The reference is the decoder's code: its apply_rope, and float64 rotation within the roundings.
    q_in, k_in, _ = qkv.split([heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim], dim=-1)
    q_in, k_in = q_in.reshape(batch, t, heads_q, head_dim), k_in.reshape(batch, t, heads_kv, head_dim)
    assert torch.equal(bits(q_expected), bits(apply_rope(q_in, cos, sin)))
    assert_f64_close(q, apply_rope(q_in.double(), cos.double(), sin.double()), atol=1e-5)
    k_rot64 = apply_rope(k_in.double(), cos.double(), sin.double())  # [B, T, H_kv, D]
    assert_f64_close(k_buf[1][torch.arange(batch, device=DEVICE)[:, None], :, positions], k_rot64, atol=1e-5)


# (H_q, H_kv, D, T, dtype, qkv layout, cache layout, positions): together T 1..5, both D, all layouts.
ROPE_CASES = [
    (9, 3, 64, 1, torch.bfloat16, "contiguous", "layer_view", "ragged"),
    (32, 8, 128, 2, torch.bfloat16, "time_major", "layer_view", "ragged"),
    (28, 4, 128, 3, torch.bfloat16, "wide", "bshd", "scattered"),
    (64, 8, 128, 1, torch.bfloat16, "contiguous", "layer_view", "scattered"),
    (14, 2, 64, 5, torch.bfloat16, "wide", "layer_view", "ragged"),
    (9, 3, 64, 4, torch.float32, "time_major", "bshd", "ragged"),
    (14, 2, 128, 2, torch.float32, "contiguous", "layer_view", "scattered"),
]


@needs_kernel
@pytest.mark.parametrize("heads_q, heads_kv, head_dim, t, dtype, qkv_layout, cache_layout, position_layout",
                         ROPE_CASES)
def test_rope_qkv_to_cache_matches_decoder(heads_q, heads_kv, head_dim, t, dtype, qkv_layout, cache_layout,
                                           position_layout):
    check_rope(3, t, heads_q, heads_kv, head_dim, dtype, qkv_layout, cache_layout, position_layout)


@needs_kernel
def test_rope_qkv_to_cache_int32_positions_and_single_sequence():
    check_rope(1, 3, 9, 3, 64, torch.bfloat16, "contiguous", "layer_view", "scattered", torch.int32)


@needs_kernel
def test_rope_forward_writes_every_q_element():
    torch.manual_seed(4)
    batch, t, heads_q, heads_kv, head_dim = 2, 3, 14, 2, 64
    qkv = randn(batch, t, (heads_q + 2 * heads_kv) * head_dim, dtype=torch.bfloat16)
    positions = make_positions(batch, t, 16, "ragged")
    cos, sin = rope_tables(positions, head_dim)
    k, v = randn(batch, heads_kv, 16, head_dim, dtype=torch.bfloat16), randn(batch, heads_kv, 16, head_dim,
                                                                            dtype=torch.bfloat16)
    q_out = torch.full((batch, t, heads_q, head_dim), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    rope_qkv_to_cache_forward(qkv, cos, sin, k, v, positions, heads_q, heads_kv, q_out)
    expected = rope_qkv_to_cache_ref(qkv, cos, sin, k.clone(), v.clone(), positions, heads_q, heads_kv, head_dim)
    assert_torch_exact(q_out, expected)


# ----------------------------------------------------------------------------------------------------------
# silu_mul


def silu_mul_f64(gate_up):
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_kernel
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp(100)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [1536, 8192, 14336, 18944, 1001])
def test_silu_mul_matches_torch(inter, dtype):
    torch.manual_seed(inter)
    gate_up = randn(2, 2, 2 * inter, dtype=dtype, scale=3.0)
    gate_up[0, 0, :6] = torch.tensor([-100.0, -20.0, -0.0, 0.0, 20.0, 100.0])  # exp over/underflow, signed zeros
    out = silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert out.shape == (2, 2, inter) and out.is_contiguous()
    assert_torch_exact(out, F.silu(gate) * up)
    assert_torch_exact(out, silu_mul_ref(gate_up))
    assert_f64_close(out, silu_mul_f64(gate_up), atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_strided_rows_poisoned_output(dtype):
    torch.manual_seed(6)
    rows, inter = 3, 2100
    gate_up = randn(rows, 2 * inter + 16, dtype=dtype)[:, 16:]
    out_buf = torch.full((rows, inter + 5), float("nan"), device=DEVICE, dtype=dtype)
    silu_mul_forward(gate_up, out_buf[:, :inter])
    assert_torch_exact(out_buf[:, :inter], silu_mul_ref(gate_up))
    assert out_buf[:, inter:].isnan().all()


# ----------------------------------------------------------------------------------------------------------
# Errors, the reference path, registration, CUDA graphs


@needs_kernel
def test_reference_path_gives_the_kernels_answer(monkeypatch):
    """Where Triton cannot run, the ops fall back to the references; both paths agree (bf16 models on CPU)."""
    from trtllm_dustin.plugins import fused_ops

    torch.manual_seed(8)
    x, delta = randn(2, 3, 576, dtype=torch.bfloat16), randn(2, 3, 576, dtype=torch.bfloat16)
    weight = randn(576, dtype=torch.bfloat16)
    gate_up = randn(2, 3, 2 * 1536, dtype=torch.bfloat16)
    qkv = randn(2, 3, 5 * 64, dtype=torch.bfloat16)
    positions = torch.tensor([[0, 1, 2], [7, 3, 5]], device=DEVICE)
    cos, sin = rope_tables(positions, 64)
    k_init, v_init = randn(2, 1, 8, 64, dtype=torch.bfloat16), randn(2, 1, 8, 64, dtype=torch.bfloat16)

    def run_ops():
        k, v = k_init.clone(), v_init.clone()
        q = rope_qkv_to_cache(qkv, cos, sin, k, v, positions, 3, 1, 64)
        return (*add_rms_norm(x, delta, weight, EPS), add_rms_norm(x, None, weight, EPS)[0], q, k, v,
                silu_mul(gate_up))

    kernels = run_ops()
    monkeypatch.setattr(fused_ops, "runs_triton", lambda t: False)
    for got, want in zip(kernels, run_ops(), strict=True):
        assert_torch_exact(got, want)


def rope_args(**changes):
    args = dict(qkv=torch.randn(2, 3, 5 * 64), cos=torch.randn(2, 3, 32), sin=torch.randn(2, 3, 32),
                k_cache=torch.randn(2, 1, 8, 64), v_cache=torch.randn(2, 1, 8, 64),
                positions=torch.zeros(2, 3, dtype=torch.long), num_heads=3, num_kv_heads=1, head_dim=64)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, message", [
    (dict(num_heads=4), r"qkv last dim is 320 but \(num_heads 4"),
    (dict(head_dim=48), "head_dim 48 is not supported"),
    (dict(qkv=torch.randn(2, 3, 640)[..., ::2]), "last-dim stride 2"),
    (dict(cos=torch.randn(2, 3, 64)), r"cos is torch.float32 \(2, 3, 64\); expected float32 \[2, 3, 32\]"),
    (dict(sin=torch.randn(2, 3, 32).double()), "sin is torch.float64"),
    (dict(k_cache=torch.randn(2, 1, 8, 64).half()), "k_cache dtype torch.float16 differs from qkv dtype"),
    (dict(v_cache=torch.randn(2, 2, 8, 64)), r"v_cache has shape \(2, 2, 8, 64\); expected \[2, 1, S_max, 64\]"),
    (dict(positions=torch.zeros(2, 3)), "positions is torch.float32"),
    (dict(positions=torch.zeros(3, 2, dtype=torch.long)), r"expected int64 or int32 \[2, 3\]"),
    (dict(k_cache=torch.randn(2, 1, 2, 64), v_cache=torch.randn(2, 1, 2, 64)), "hold 2 positions, fewer than"),
])
def test_rope_errors_name_the_problem(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        rope_qkv_to_cache(**rope_args(**changes))


@pytest.mark.parametrize("x, delta, weight, message", [
    (torch.randn(2, 64), torch.randn(2, 32), torch.randn(64), r"delta shape \(2, 32\) differs from x shape"),
    (torch.randn(2, 64), None, torch.randn(32), r"weight shape \(32,\) does not match x last dim 64"),
    (torch.randn(2, 64), None, torch.randn(64).bfloat16(), "weight dtype torch.bfloat16 differs from x dtype"),
    (torch.randn(2, 64).int(), None, torch.randn(64), "x dtype torch.int32 is not supported"),
    (torch.randn(64, 2).t(), None, torch.randn(64), "last-dim stride 2"),
    (torch.randn(1, 16385), None, torch.randn(16385), "x last dim is 16385; the kernel normalises rows of 1..16384"),
])
def test_add_rms_norm_errors_name_the_problem(x, delta, weight, message):
    with pytest.raises((ValueError, TypeError), match=message):
        add_rms_norm(x, delta, weight, EPS)


@pytest.mark.parametrize("gate_up, message", [
    (torch.randn(2, 7), "gate_up last dim is 7, not even"),
    (torch.randn(2, 8).long(), "gate_up dtype torch.int64 is not supported"),
    (torch.randn(8, 2).t(), "last-dim stride 2"),
])
def test_silu_mul_errors_name_the_problem(gate_up, message):
    with pytest.raises((ValueError, TypeError), match=message):
        silu_mul(gate_up)


def test_opcheck():
    """Schemas, fake impls and mutation annotations of the three registered ops are consistent."""
    torch.manual_seed(9)
    tests = ("test_schema", "test_faketensor")
    x, delta, weight = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE), torch.randn(64,
                                                                                                       device=DEVICE)
    torch.library.opcheck(torch.ops.trtllm_dustin.add_rms_norm.default,
                          (x, delta, weight, EPS, torch.empty_like(x), torch.empty_like(x), False), test_utils=tests)
    torch.library.opcheck(torch.ops.trtllm_dustin.add_rms_norm.default,
                          (x, None, weight, EPS, torch.empty_like(x), None, False), test_utils=tests)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in rope_args().items()}
    args["positions"] = torch.tensor([[0, 1, 2], [5, 6, 7]], device=DEVICE)
    torch.library.opcheck(torch.ops.trtllm_dustin.rope_qkv_to_cache.default, (*args.values(), False),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.trtllm_dustin.silu_mul.default, (torch.randn(3, 2, 96, device=DEVICE), False),
                          test_utils=tests)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    """The three ops capture in one graph; replaying on new inputs matches eager calls."""
    torch.manual_seed(7)
    batch, t, hidden, heads_q, heads_kv, head_dim, inter, s_max = 4, 2, 2048, 32, 8, 64, 5632, 64
    dtype = torch.bfloat16
    h, delta, weight = randn(batch, t, hidden, dtype=dtype), randn(batch, t, hidden, dtype=dtype), randn(
        hidden, dtype=dtype)
    qkv = randn(batch, t, (heads_q + 2 * heads_kv) * head_dim, dtype=dtype)
    gate_up = randn(batch, t, 2 * inter, dtype=dtype)
    positions = make_positions(batch, t, s_max, "ragged")
    cos, sin = rope_tables(positions, head_dim)
    k_buf, v_buf = randn(2, batch, heads_kv, s_max, head_dim, dtype=dtype), randn(2, batch, heads_kv, s_max,
                                                                                  head_dim, dtype=dtype)

    def step():
        normed, summed = add_rms_norm(h, delta, weight, EPS)
        q = rope_qkv_to_cache(qkv, cos, sin, k_buf[1], v_buf[1], positions, heads_q, heads_kv, head_dim)
        return normed, summed, q, silu_mul(gate_up)

    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for t_in in (h, delta, qkv, gate_up):
        t_in.copy_(torch.randn_like(t_in))
    positions.copy_(make_positions(batch, t, s_max, "scattered"))
    new_cos, new_sin = rope_tables(positions, head_dim)
    cos.copy_(new_cos)
    sin.copy_(new_sin)
    graph.replay()
    torch.cuda.synchronize()
    k_graph, v_graph = k_buf.clone(), v_buf.clone()
    eager = step()
    for got, want in zip(outputs, eager, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(k_graph, k_buf) and torch.equal(v_graph, v_buf)
