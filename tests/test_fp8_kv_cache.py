"""FP8 (e4m3) KV caches: every kernel that reads or writes a cache against its reference on the same fp8 cache, the
saturating store, and the invariant that makes an fp8 draft cache safe: Classic SD with it still emits exactly the
target's greedy tokens (the draft only proposes; the bf16 target decides).

CPU: the kernels run under TRITON_INTERPRET=1; the larger sweep needs CUDA.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.attention import AttentionMetadata, get_backend  # noqa: E402
from trtllm_dustin.config import ModelConfig  # noqa: E402
from trtllm_dustin.kv_cache import KVCache  # noqa: E402
from trtllm_dustin.models.decoder import Transformer  # noqa: E402
from trtllm_dustin.plugins import sparse_verify_attention, srh_score, verify_attention  # noqa: E402
from trtllm_dustin.plugins.fused_ops import rope_qkv_to_cache, rope_qkv_to_cache_ref  # noqa: E402
from trtllm_dustin.plugins.kv_dtype import FP8_KV_DTYPE, FP8_MAX, to_cache_dtype  # noqa: E402
from trtllm_dustin.plugins.reference import (  # noqa: E402
    sparse_verify_attention_ref,
    srh_score_ref,
    verify_attention_ref,
)
from trtllm_dustin.runtime.build import build_decoder  # noqa: E402
from trtllm_dustin.runtime.generation import GenerationConfig  # noqa: E402
from trtllm_dustin.runtime.methods import MethodSetup  # noqa: E402

FP8 = FP8_KV_DTYPE


def fp8_cache(batch, heads_kv, s_max, head_dim, scale=3.0):
    """A [B, H_kv, S_max, D] fp8 cache (one layer of a 3-layer buffer, as the model indexes it)."""
    return to_cache_dtype(scale * torch.randn(3, batch, heads_kv, s_max, head_dim, device=DEVICE), FP8)[1]


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def test_store_saturates_and_rounds_like_a_cast():
    x = torch.tensor([1000.0, -3000.0, 448.0, 2.51, -0.769, 14.18, float("inf")])
    y = to_cache_dtype(x, FP8)
    assert y.dtype == FP8
    assert y.float().tolist()[:3] == [FP8_MAX, -FP8_MAX, FP8_MAX]  # no inf from an outlier
    assert y.float()[6] == FP8_MAX
    assert torch.equal(y[3:6].float(), x[3:6].to(FP8).float())  # in range: exactly torch's rounding
    assert to_cache_dtype(x, torch.bfloat16).dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("t, group, head_dim, qdtype", [(1, 4, 64, torch.bfloat16), (4, 3, 128, torch.bfloat16),
                                                        (2, 1, 64, torch.float32)])
def test_verify_attention_reads_fp8_as_the_reference_does(t, group, head_dim, qdtype):
    torch.manual_seed(t * 10 + group)
    lengths, heads_kv = [77, 30, 5], 2
    s_max = max(lengths) + t + 3
    q = torch.randn(3, t, heads_kv * group, head_dim, device=DEVICE).to(qdtype)
    k, v = fp8_cache(3, heads_kv, s_max, head_dim), fp8_cache(3, heads_kv, s_max, head_dim, scale=0.5)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = verify_attention(q, k, v, seqlens, return_lse=True)
    # Oracle: float64 attention over the dequantized cache.
    ref, ref_lse = verify_attention_ref(q.double(), k.double(), v.double(), seqlens, return_lse=True)
    rel, _ = TOLERANCE[qdtype]
    assert out.dtype == qdtype and rel_err(out, ref) < rel
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-3 if qdtype == torch.bfloat16 else 1e-5)
    # The bf16 cache holding the same values gives the same answer: fp8 changes only what is stored.
    out16 = verify_attention(q, k.to(qdtype), v.to(qdtype), seqlens)
    assert rel_err(out, out16.double()) < rel


@needs_kernel
def test_sparse_verify_attention_and_srh_score_read_fp8():
    torch.manual_seed(3)
    lengths, heads_kv, group, head_dim, t = [90, 41], 2, 4, 64, 4
    s_max = max(lengths) + t + 2
    q = torch.randn(2, t, heads_kv * group, head_dim, device=DEVICE).to(torch.bfloat16)
    k, v = fp8_cache(2, heads_kv, s_max, head_dim), fp8_cache(2, heads_kv, s_max, head_dim, scale=0.5)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    indices = torch.full((2, 32), -1, dtype=torch.int32, device=DEVICE)
    for b, length in enumerate(lengths):
        chosen = torch.randperm(length)[:24].sort().values
        indices[b, : len(chosen)] = chosen.to(torch.int32)
    out = sparse_verify_attention(q, k, v, seqlens, indices)
    ref = sparse_verify_attention_ref(q.double(), k.double(), v.double(), seqlens, indices)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16][0]

    heads = (0, 5)
    scores = srh_score(q, k, seqlens, heads)
    ref_scores = srh_score_ref(q.double(), k.double(), seqlens, heads).double()
    assert rel_err(scores, ref_scores) < 1e-4
    assert (scores[torch.arange(s_max, device=DEVICE)[None, :] >= seqlens[:, None]] == 0).all()


@needs_kernel
@pytest.mark.parametrize("heads_q, heads_kv, head_dim, t", [(9, 3, 64, 1), (8, 2, 128, 3)])
def test_rope_qkv_to_cache_stores_fp8_like_the_reference(heads_q, heads_kv, head_dim, t):
    torch.manual_seed(heads_q + t)
    batch, s_max = 2, 11
    qkv = (4 * torch.randn(batch, t, (heads_q + 2 * heads_kv) * head_dim, device=DEVICE)).to(torch.bfloat16)
    qkv[0, 0, -1] = 900.0  # a V outlier past the fp8 range: saturates to 448
    positions = torch.stack([torch.randperm(s_max)[:t] for _ in range(batch)]).to(DEVICE)
    angles = positions[..., None].double() * 10000.0 ** (-torch.arange(head_dim // 2, device=DEVICE) * 2 / head_dim)
    cos, sin = angles.cos().float(), angles.sin().float()
    k_ref = torch.zeros(batch, heads_kv, s_max, head_dim, dtype=FP8, device=DEVICE)
    v_ref = torch.zeros_like(k_ref)
    q_ref = rope_qkv_to_cache_ref(qkv, cos, sin, k_ref, v_ref, positions, heads_q, heads_kv, head_dim)
    k_out, v_out = torch.zeros_like(k_ref), torch.zeros_like(k_ref)
    q = rope_qkv_to_cache(qkv, cos, sin, k_out, v_out, positions, heads_q, heads_kv, head_dim)
    assert torch.equal(q, q_ref)
    assert v_out.float().abs().max() == FP8_MAX and torch.isfinite(v_out.float()).all()
    for out, ref in ((k_out, k_ref), (v_out, v_ref)):  # bit for bit: the kernel rounds as torch's cast does
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@needs_kernel
def test_fp8_store_rounding_matches_torch_on_every_boundary():
    """Ties, carries across powers of two, subnormals, saturation: every representable value and every midpoint."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([449.0, 500.0, -1e6, 2.0 ** -10, -(2.0 ** -11)])])
    width = 64
    x = torch.cat([x, torch.zeros((-len(x)) % width)]).to(DEVICE)
    rows = len(x) // width
    # V passes through rope_qkv_to_cache unrotated: a 1-head model whose v columns are the values under test.
    qkv = torch.cat([torch.zeros(rows, 2 * width, device=DEVICE), x.view(rows, width)], 1)[:, None]  # [rows, 1, 3D]
    positions = torch.zeros(rows, 1, dtype=torch.int64, device=DEVICE)
    cos = torch.ones(rows, 1, width // 2, device=DEVICE)
    sin = torch.zeros_like(cos)
    k_out = torch.zeros(rows, 1, 1, width, dtype=FP8, device=DEVICE)
    v_out = torch.zeros_like(k_out)
    rope_qkv_to_cache(qkv, cos, sin, k_out, v_out, positions, 1, 1, width)
    expected = to_cache_dtype(x, FP8).view(rows, 1, 1, width)
    assert torch.equal(v_out.view(torch.uint8), expected.view(torch.uint8))


def tiny_config(**changes):
    base = dict(name="tiny", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256)
    base.update(changes)
    return ModelConfig(**base)


def test_kv_cache_write_and_reference_attention_on_fp8():
    config = tiny_config()
    cache = KVCache.allocate(config, 2, 16, FP8, "cpu")
    assert cache.k.dtype == FP8 and cache.k.element_size() == 1
    assert KVCache.nbytes_for(config, 2, 16, FP8) * 2 == KVCache.nbytes_for(config, 2, 16, torch.bfloat16)
    k_new = 600 * torch.ones(2, 3, 2, 16)
    cache.write(1, k_new, -k_new, torch.tensor([[0, 1, 2], [4, 5, 6]]))
    assert cache.k[1, 1, :, 4:7].float().eq(FP8_MAX).all() and cache.v[1, 0, :, :3].float().eq(-FP8_MAX).all()
    q = torch.randn(2, 1, 4, 16)
    cache.seqlens.fill_(3)
    out = get_backend("reference").attend(q, *cache.layer(1), AttentionMetadata(cache_seqlens=cache.seqlens))
    assert out.dtype == q.dtype and torch.isfinite(out).all()


def test_classic_sd_with_an_fp8_draft_cache_emits_the_targets_greedy_tokens():
    """The draft's cache precision may move the acceptance rate, never the output: Classic SD is lossless."""
    torch.manual_seed(0)
    target, draft = Transformer(tiny_config()).eval(), Transformer(tiny_config(num_layers=1)).eval()
    with torch.no_grad():
        for p in list(target.parameters()) + list(draft.parameters()):
            p.mul_(4.0)  # sharper distributions: fewer argmax near-ties between the two paths
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (23, 9)]
    cfg = GenerationConfig(max_new_tokens=20, eos_token_ids=())
    backend = get_backend("reference")

    def run(method, draft_dtype):
        setup = MethodSetup(target=target, target_cache=KVCache.allocate(target.config, 2, 64, torch.float32, "cpu"),
                            backend=backend, draft=draft, gamma=3, use_cuda_graph=False,
                            draft_cache=KVCache.allocate(draft.config, 2, 64, draft_dtype, "cpu"))
        return build_decoder(method, setup).generate(prompts, cfg)

    vanilla = run("vanilla", torch.float32)
    fp8 = run("classic", FP8)
    assert fp8.tokens == vanilla.tokens
    assert sum(fp8.committed_hist) > 0


@needs_kernel
def test_errors_name_the_cache_dtypes():
    q = torch.randn(1, 1, 4, 64, device=DEVICE).to(torch.bfloat16)
    k = torch.zeros(1, 2, 8, 64, dtype=FP8, device=DEVICE)
    seqlens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="v_cache dtype torch.bfloat16 differs from k_cache dtype"):
        verify_attention(q, k, k.to(torch.bfloat16), seqlens)
    with pytest.raises(TypeError, match="q dtype torch.float8_e4m3fn is not supported"):
        verify_attention(k[:, :1, :1].reshape(1, 1, 1, 64).expand(1, 1, 4, 64), k, k, seqlens)


@needs_cuda
@pytest.mark.parametrize("length, t, group", [(4096, 1, 4), (32768, 1, 4), (1000, 4, 8), (5000, 2, 7)])
def test_verify_attention_fp8_sweep_gpu(length, t, group):
    torch.manual_seed(length + t)
    heads_kv, head_dim = 8, 64 if group != 8 else 128
    lengths = [length, length // 2, length // 3 + 1, 17]
    s_max = length + t + 8
    q = torch.randn(4, t, heads_kv * group, head_dim, device=DEVICE).to(torch.bfloat16)
    k, v = fp8_cache(4, heads_kv, s_max, head_dim), fp8_cache(4, heads_kv, s_max, head_dim, scale=0.5)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = verify_attention(q, k, v, seqlens)
    ref = verify_attention_ref(q.double(), k.double(), v.double(), seqlens)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16][0]
    assert math.isfinite(float(out.float().sum()))
