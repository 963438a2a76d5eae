"""Input checks shared by the kernel launchers.

Every check reads only host-known metadata (shapes, dtypes, strides, devices), never tensor
values, so the ops stay CUDA-graph capturable. Each message names the value, the limit and a fix.
"""

import torch

__all__ = ["MAX_QUERY_TOKENS", "check_attention_inputs", "check_out"]

MAX_QUERY_TOKENS = 16
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def check_attention_inputs(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           cache_seqlens: torch.Tensor, max_tokens: int | None = MAX_QUERY_TOKENS) -> None:
    """q [B, T, H_q, D]; k_cache / v_cache [B, H_kv, S_max, D]; cache_seqlens int32 [B]. max_tokens: the most query
    tokens per sequence the op takes (None: any, the prefill op)."""
    if q.dim() != 4:
        raise ValueError(f"{op}: q has shape {tuple(q.shape)}; expected 4 dims [B, T, H_q, D]")
    if k_cache.dim() != 4:
        raise ValueError(f"{op}: k_cache has shape {tuple(k_cache.shape)}; expected 4 dims [B, H_kv, S_max, D] "
                         "(index the layer out of a [n_layers, B, H_kv, S_max, D] buffer first)")
    batch, t, heads_q, head_dim = q.shape
    kb, heads_kv, s_max, kd = k_cache.shape
    caches = [("k_cache", k_cache)] + ([("v_cache", v_cache)] if v_cache is not None else [])
    if v_cache is not None and v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}; pass the same layer's K and V")
    if kb != batch:
        raise ValueError(f"{op}: q has batch {batch} but k_cache has {kb} slots; pass the cache rows of this batch")
    if kd != head_dim:
        raise ValueError(f"{op}: q head dim {head_dim} differs from k_cache head dim {kd}")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"{op}: head dim {head_dim} is not supported; use one of {_HEAD_DIMS}")
    if t < 1 or (max_tokens is not None and t > max_tokens):
        raise ValueError(f"{op}: {t} query tokens per sequence; the kernels take 1..{max_tokens}, "
                         "split the step or verify fewer draft tokens (prompts go to prefill_attention)")
    if heads_q % heads_kv != 0:
        raise ValueError(f"{op}: q has {heads_q} heads, not a multiple of k_cache's {heads_kv} KV heads; "
                         "query head h must use KV head h // (H_q / H_kv)")
    if q.dtype not in _CACHE_DTYPES:
        raise TypeError(f"{op}: q dtype {q.dtype} is not supported; use bfloat16, float16 or float32")
    for name, cache in caches:
        if cache.dtype != q.dtype and cache.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{op}: {name} dtype {cache.dtype} differs from q dtype {q.dtype}; "
                            "cast q to the cache dtype (a cache may also be float8_e4m3fn, read as q's dtype)")
        if cache.stride(-1) != 1:
            raise ValueError(f"{op}: {name} last dim has stride {cache.stride(-1)}; the head dim must be contiguous")
        if cache.device != q.device:
            raise ValueError(f"{op}: {name} is on {cache.device} but q is on {q.device}; put them on one device")
    if v_cache is not None and v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{op}: v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}; "
                        "pass the same layer's K and V")
    if q.stride(-1) != 1:
        raise ValueError(f"{op}: q last dim has stride {q.stride(-1)}; the head dim must be contiguous")
    if cache_seqlens.shape != (batch,) or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: cache_seqlens is {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}; "
                         f"expected int32 [{batch}] (committed length per sequence)")
    if cache_seqlens.device != q.device:
        raise ValueError(f"{op}: cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    if s_max < t:
        raise ValueError(f"{op}: k_cache holds {s_max} positions, fewer than the {t} new tokens")


def check_out(op: str, out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """A caller-supplied output buffer must match exactly; only its last dim must be contiguous."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"{op}: out is {out.dtype} {tuple(out.shape)} on {out.device}; "
                         f"expected {dtype} {tuple(shape)} on {device}")
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: out last dim has stride {out.stride(-1)}; it must be contiguous")
