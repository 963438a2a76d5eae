"""Programmatic dependent launch (plugins/pdl.py): where it is supported, and that a PDL launch never reads what the
kernel before it in the stream is still writing.

The GPU test chains, inside one CUDA graph, the kernels that run back to back in a verify layer: the fused rotary +
cache write produces q and the new tokens' K/V, and the attention kernel launched right after it must see them.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import needs_cuda, needs_interpreter  # noqa: E402

from trtllm_dustin.plugins import pdl  # noqa: E402
from trtllm_dustin.plugins.fused_ops import rope_qkv_to_cache, rope_qkv_to_cache_ref  # noqa: E402
from trtllm_dustin.plugins.reference import sparse_verify_attention_ref, verify_attention_ref  # noqa: E402
from trtllm_dustin.plugins.sparse_verify_attention import sparse_verify_attention_forward  # noqa: E402
from trtllm_dustin.plugins.verify_attention import verify_attention_forward  # noqa: E402


def test_unsupported_on_cpu_and_ignores_the_environment(monkeypatch):
    """Support is the hardware's and Triton's; the TRTLLM_DUSTIN_PDL switch is KernelConfig's, never read here."""
    monkeypatch.setenv("TRTLLM_DUSTIN_PDL", "1")
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}
    assert pdl.gdc_args(False) == {"USE_GDC": False}


@needs_interpreter
def test_a_cpu_launch_asked_for_pdl_runs_without_it():
    """pdl=True on a device without PDL launches plainly (the CPU interpreter has no launch_pdl option)."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    seqlens = torch.tensor([30, 5], dtype=torch.int32)
    out, lse = torch.full_like(q, float("nan")), torch.empty(2, 2, 4)
    verify_attention_forward(q, k, v, seqlens, 0.25, out, lse, pdl=True)
    torch.testing.assert_close(out, verify_attention_ref(q, k, v, seqlens, 0.25), rtol=1e-5, atol=1e-5)


def _rope_tables(head_dim, positions):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = positions.float()[..., None] * inv  # [B, T, D/2]
    return angles.cos(), angles.sin()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sparse", "full"])
def test_attention_sees_what_the_previous_kernel_wrote(kind):
    """rope_qkv_to_cache then attention, captured in one graph with PDL on, replayed on new inputs: the attention
    output equals the float64 reference on the caches and q the rotary kernel wrote in the same replay."""
    if not pdl.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL is not supported here (Triton without launch_pdl, or pre-sm_90)")
    torch.manual_seed(5)
    batch, t, heads, heads_kv, head_dim, length = 4, 4, 32, 8, 128, 3000
    s_max = length + 8
    dtype = torch.bfloat16
    k_cache = torch.randn(batch, heads_kv, s_max, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([length, 2000, 1234, 77], dtype=torch.int32, device="cuda")
    positions = seqlens[:, None].long() + torch.arange(t, device="cuda")[None, :]
    cos, sin = _rope_tables(head_dim, positions)
    qkv = torch.randn(batch, t, (heads + 2 * heads_kv) * head_dim, device="cuda", dtype=dtype)
    indices = torch.full((batch, 512), -1, dtype=torch.int32, device="cuda")
    for b, n in enumerate(seqlens.tolist()):
        chosen = torch.randperm(n, device="cuda")[:512]
        indices[b, : len(chosen)] = chosen.to(torch.int32)
    scale = head_dim ** -0.5
    out = torch.empty(batch, t, heads, head_dim, device="cuda", dtype=dtype)
    lse = torch.empty(batch, t, heads, device="cuda")
    q_holder = {}

    def step():
        q = rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, positions, heads, heads_kv, head_dim, pdl=True)
        q_holder["q"] = q
        if kind == "full":
            verify_attention_forward(q, k_cache, v_cache, seqlens, scale, out, lse, pdl=True)
        else:
            sparse_verify_attention_forward(q, k_cache, v_cache, seqlens, indices, scale, out, lse, pdl=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        qkv.copy_(torch.randn_like(qkv))  # new q and new-token K/V for the rotary kernel to write; the new tokens'
        qkv[..., (heads + heads_kv) * head_dim:] *= 50  # V is large, so attention over a stale copy of it shows
        out.fill_(float("nan"))
        stale_k = k_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        k_ref, v_ref = stale_k, v_cache.clone()
        q_ref = rope_qkv_to_cache_ref(qkv, cos, sin, k_ref, v_ref, positions, heads, heads_kv, head_dim)
        torch.testing.assert_close(k_cache, k_ref)  # the rotary kernel wrote this replay's new tokens
        torch.testing.assert_close(q_holder["q"], q_ref)
        q, k_now, v_now = q_holder["q"].double(), k_cache.double(), v_cache.double()  # what the graph left behind
        if kind == "full":
            expected = verify_attention_ref(q, k_now, v_now, seqlens, scale)
        else:
            expected = sparse_verify_attention_ref(q, k_now, v_now, seqlens, indices, scale)
        assert torch.isfinite(out).all()
        err = (out.double() - expected).norm() / expected.norm()
        assert err < 1.5e-2, f"replay {replay}: relative error {err:.2e} (stale q or new-token K/V read?)"
