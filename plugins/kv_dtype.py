"""FP8 (e4m3) KV caches: how values go in and come out, shared by every kernel that touches a cache.

A cache of dtype float8_e4m3fn stores each K/V element as it is (no per-tensor scale), saturated to +-448, the
format's largest finite value, so an outlier becomes 448 instead of inf. Kernels load a tile of such a cache and
upcast it before any arithmetic (to fp16 for a bf16 query, `compute_q`; to the query's dtype otherwise); the
references do the same with `.to(float32)`. This halves the bytes a decode step reads from the cache. The use it was
built for is the draft's cache in speculative decoding: the draft only proposes tokens, the target (kept in bf16)
decides them. The SmolLM2 draft's K and V peak at 21 and 14 over a 4K prompt, far inside the range; values below
2^-10 (about 0.001) round to zero.
"""

import torch
import triton
import triton.language as tl

__all__ = ["DRAFT_KV_CHOICES", "FP8_KV_DTYPE", "FP8_MAX", "compute_q", "draft_kv_dtype", "is_fp8", "store_cast",
           "to_cache_dtype"]

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


# What --draft-kv-cache / ServingConfig.draft_kv_cache accept: the model's dtype, or fp8.
DRAFT_KV_CHOICES = ("model", "fp8")


def draft_kv_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The draft cache's dtype for a DRAFT_KV_CHOICES name."""
    if choice not in DRAFT_KV_CHOICES:
        raise ValueError(f"draft KV cache {choice!r} must be one of {DRAFT_KV_CHOICES}")
    return FP8_KV_DTYPE if choice == "fp8" else model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: a plain cast, saturating at +-448 for an fp8 cache (what the kernels store)."""
    if is_fp8(dtype):
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


@triton.jit
def _round_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, subnormals included: done in fp32
    arithmetic so the final conversion is exact everywhere (the Triton interpreter's own fp32 -> fp8 conversion
    drops the carry when rounding up across a power of two: 7.9 -> 4.0)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6 the grid is the subnormals' fixed 2^-9
    inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): 3 mantissa bits
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer, ties to even
    rounded = ((tl.abs(x) * inv_step + magic) - magic) * step
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign


@triton.jit
def store_cast(x, FP8: tl.constexpr, out_dtype: tl.constexpr):
    """x converted for a store into a cache of element type out_dtype (saturating and rounded as torch's cast
    when FP8)."""
    if FP8:
        return _round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)).to(out_dtype)
    return x.to(out_dtype)


@triton.jit
def compute_q(q, k_ptr):
    """q in the dtype a kernel computes with over the cache at k_ptr: fp16 for a bf16 q over an fp8 cache, so that
    every K/V tile converts fp8 -> fp16 (one hardware instruction per pair of values on sm_89+; fp8 -> bf16 takes
    several, which made a draft step's attention 1.4x slower than over a bf16 cache on the H200), else q itself."""
    if k_ptr.dtype.element_ty.is_fp8():
        if q.dtype.is_bf16():
            q = q.to(tl.float16)
    return q
