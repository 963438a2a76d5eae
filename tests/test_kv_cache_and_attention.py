"""The cache layout and the reference attention backend: writes land where the kernels will read them."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import get_preset


def naive_attention(q, keys, values, scale):
    """float64 softmax(q k^T) v for one query head: q [D], keys/values [N, D]."""
    w = torch.softmax((keys.double() @ q.double()) * scale, dim=0)
    return w @ values.double()


def test_write_places_rows_at_per_sequence_positions() -> None:
    config = get_preset("tiny-llama")
    cache = KVCache.allocate(config, 3, 32, torch.float32, "cpu")
    k_new = torch.randn(3, 4, config.num_kv_heads, config.head_dim)
    positions = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13], [28, 29, 30, 31]])
    cache.write(1, k_new, -k_new, positions)
    for b in range(3):
        for t in range(4):
            torch.testing.assert_close(cache.k[1, b, :, positions[b, t]], k_new[b, t], rtol=0, atol=0)
            torch.testing.assert_close(cache.v[1, b, :, positions[b, t]], -k_new[b, t], rtol=0, atol=0)
    assert cache.k[0].abs().sum() == 0 and cache.k[2].abs().sum() == 0  # other layers untouched


def test_memory_estimate_matches_allocation() -> None:
    config = get_preset("tiny-qwen")
    cache = KVCache.allocate(config, 2, 48, torch.bfloat16, "cpu")
    assert KVCache.nbytes_for(config, 2, 48, torch.bfloat16) == cache.k.nbytes + cache.v.nbytes


@pytest.mark.parametrize("group", [1, 3])
def test_reference_full_and_sparse_attention(group: int) -> None:
    torch.manual_seed(0)
    B, T, Hkv, S, D = 3, 4, 2, 50, 16
    Hq = Hkv * group
    k_cache, v_cache = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    lens = torch.tensor([5, 20, 41], dtype=torch.int32)
    q = torch.randn(B, T, Hq, D)
    backend = get_backend("reference")
    full = backend.attend(q, k_cache, v_cache, AttentionMetadata(lens))
    indices = torch.full((B, 12), -1, dtype=torch.int32)
    chosen = [torch.tensor([0, 3]), torch.tensor([1, 2, 7, 19]), torch.tensor([0, 5, 9, 30, 33, 40])]
    for b, c in enumerate(chosen):
        indices[b, : len(c)] = c
    sparse = backend.attend(q, k_cache, v_cache, AttentionMetadata(lens, indices=indices))
    scale = 1 / math.sqrt(D)
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                g = h // group
                L = int(lens[b])
                want = naive_attention(q[b, t, h], k_cache[b, g, : L + t + 1], v_cache[b, g, : L + t + 1], scale)
                torch.testing.assert_close(full[b, t, h].double(), want, atol=1e-5, rtol=1e-5)
                rows = torch.cat([chosen[b], torch.arange(L, L + t + 1)])
                want = naive_attention(q[b, t, h], k_cache[b, g, rows], v_cache[b, g, rows], scale)
                torch.testing.assert_close(sparse[b, t, h].double(), want, atol=1e-5, rtol=1e-5)
    # Sparse over every context position is full attention.
    every = torch.full((B, S), -1, dtype=torch.int32)
    for b in range(B):
        every[b, : lens[b]] = torch.arange(int(lens[b]))
    torch.testing.assert_close(backend.attend(q, k_cache, v_cache, AttentionMetadata(lens, indices=every)), full)
