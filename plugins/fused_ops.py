"""Fused elementwise ops of a decoder layer: residual add + RMSNorm, rotary embedding + KV-cache write, SiLU-and-mul.

In a CUDA graph each small torch kernel still costs 2-3 us on an H200, and the decoder's RMSNorm (8 ops),
rotary embedding (about 10 ops each for q and k), cache scatter, SiLU, product and residual adds add up to
about 130 us per layer. Each op here is one pass over its data in one launch.

The ops reproduce the decoder's torch code, not just its mathematics: every intermediate is rounded to the
dtype torch rounds it to (see each `*_ref`), and the kernels are compiled without FMA contraction
(`enable_fp_fusion=False`) because torch runs the multiplies and the adds as separate rounded kernels. What
can still differ is the last fp32 bits of a reduction order, of rsqrt and of exp (approximate instructions on
the GPU, libm on the CPU), which flip the rounding of a bf16 output by one ulp on a small fraction of the elements
(the tests bound it); fp32 outputs of the norm and of silu_mul are a few ulps from torch's for the same reason.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kv_dtype import is_fp8, store_cast, to_cache_dtype
from .launch import launch_table
from .pdl import gdc_args, gdc_launch_if, gdc_wait_if, pdl_supported
from .split_kv import interpreting, runs_triton

__all__ = [
    "FUSED_DTYPES",
    "MAX_NORM_DIM",
    "add_rms_norm",
    "add_rms_norm_forward",
    "add_rms_norm_ref",
    "rope_qkv_to_cache",
    "rope_qkv_to_cache_forward",
    "rope_qkv_to_cache_ref",
    "silu_mul",
    "silu_mul_forward",
    "silu_mul_ref",
]

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the fused kernels take
_HEAD_DIMS = (16, 32, 64, 128, 256)
# A norm row lives in registers (32 fp32 values per thread at 16 warps for 16384); wider rows need a looped kernel.
MAX_NORM_DIM = 16384
# The launches (launch.py's table): silu_mul takes 1024 columns per program, 8 bf16 (one 16-byte load) per thread at
# 4 warps; the rotary embedding's program covers a [heads, D] tile of 2048 elements (16 heads at D = 128), so that a
# decode step's B * T tokens still make several programs each; a norm row has about 8 bf16 per thread.


def _soft_bf16() -> bool:
    """Round fp32 -> bf16 in integer arithmetic? Triton 3.9's interpreter truncates that cast (GPUs round to
    nearest even, as torch does), so under the interpreter the kernels round by hand to stay bit-exact."""
    return interpreting()


@triton.jit
def _round_to(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 x -> dtype, rounded to nearest even like torch's casts."""
    if SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, 0x7FC0, bits >> 16)  # NaN stays NaN rather than carrying into the sign bit
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# ----------------------------------------------------------------------------------------------------------
# References: the decoder's torch code, used on the CPU path and by the tests.


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """summed = x + delta (x itself without delta); normed = the decoder's RMSNorm of summed."""
    summed = x if delta is None else x + delta
    sf = summed.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, summed


def rope_qkv_to_cache_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> torch.Tensor:
    """Rotate q and k of the fused projection, store k and v at `positions`; returns q [B, T, H_q, D]."""
    from trtllm_dustin.models.rope import apply_rope  # here, not at the top: the decoder imports this module

    batch, t = qkv.shape[:2]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.reshape(batch, t, num_heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(batch, t, num_kv_heads, head_dim), cos, sin)
    batch_idx = torch.arange(batch, device=qkv.device)[:, None]  # [B, 1]
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is [B, T, H_kv, D].
    k_cache[batch_idx, :, positions] = to_cache_dtype(k, k_cache.dtype)
    v_cache[batch_idx, :, positions] = to_cache_dtype(v.reshape(batch, t, num_kv_heads, head_dim), v_cache.dtype)
    return q.contiguous()


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I], each op rounded to the input dtype as torch does."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------------------
# Input checks: host metadata only (no tensor values), so the ops stay CUDA-graph capturable.


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FUSED_DTYPES:
        raise TypeError(f"{op}: {name} dtype {t.dtype} is not supported; use bfloat16, float16 or float32")
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} has last-dim stride "
                         f"{t.stride(-1) if t.dim() else None}; the last dim must be contiguous (call .contiguous())")


def _check_like(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, fp8_ok: bool = False) -> None:
    if t.dtype != ref.dtype and not (fp8_ok and is_fp8(t.dtype)):
        raise TypeError(f"{op}: {name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}; "
                        f"cast {name} to {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; put them on one device")
    if t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} last dim has stride {t.stride(-1)}; it must be contiguous (call .contiguous())")


# ----------------------------------------------------------------------------------------------------------
# add_rms_norm


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, normed_ptr, summed_ptr,
    stride_x, stride_delta, stride_normed, stride_summed,
    n_cols, inv_n_cols, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_wait_if(USE_GDC)  # PDL: wait for the previous kernel, then let the next launch be scheduled
    gdc_launch_if(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=col_ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=col_ok, other=0.0)
        x = _round_to(x.to(tl.float32) + delta.to(tl.float32), x.dtype, SOFT_BF16)  # torch: fp32 add, one rounding
        tl.store(summed_ptr + row * stride_summed + cols, x, mask=col_ok)
    xf = x.to(tl.float32)
    # Like torch's CUDA kernels: mean multiplies the sum by 1/N, and rsqrt is the approximate (2 ulp) one.
    mean_square = tl.sum(xf * xf, 0) * inv_n_cols
    y = _round_to(xf * tl.math.rsqrt(mean_square + eps), x.dtype, SOFT_BF16)  # cast back before the weight
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0)
    normed = weight.to(tl.float32) * y.to(tl.float32)
    tl.store(normed_ptr + row * stride_normed + cols, _round_to(normed, x.dtype, SOFT_BF16), mask=col_ok)


def add_rms_norm_forward(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         normed: torch.Tensor, summed: torch.Tensor | None, pdl: bool = False) -> None:
    """Launch the add + RMSNorm kernel (inputs already validated).

    Launch contract:
      x:      [M, N] bf16 / fp16 / fp32, last dim contiguous, any row stride; N <= MAX_NORM_DIM
      delta:  [M, N] x.dtype, last dim contiguous, or None (then summed is None and x is normalised)
      weight: [N] x.dtype, contiguous
      normed: [M, N] x.dtype, last dim contiguous (written): weight * RMSNorm(x + delta) rounded as torch does
      summed: [M, N] x.dtype, last dim contiguous (written): x + delta
      grid:   (M,); one program owns a whole row in registers (BLOCK = next power of 2 >= N, masked)
      pdl:    programmatic dependent launch where pdl_supported
    """
    rows, cols = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(cols)
    choice = launch_table(x.device).fused_ops
    num_warps = min(choice.norm_max_warps, max(choice.norm_min_warps, block // choice.norm_columns_per_warp))
    has_delta = delta is not None
    _add_rms_norm_kernel[(rows,)](
        x, delta if has_delta else x, weight, normed, summed if has_delta else normed,
        x.stride(0), delta.stride(0) if has_delta else 0, normed.stride(0), summed.stride(0) if has_delta else 0,
        cols, 1.0 / cols, eps,
        HAS_DELTA=has_delta, BLOCK=block, SOFT_BF16=_soft_bf16(), num_warps=num_warps, enable_fp_fusion=False,
        **gdc_args(pdl and pdl_supported(x.device)),
    )


@torch.library.custom_op("trtllm_dustin::add_rms_norm", mutates_args=("normed", "summed"))
def _add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     normed: torch.Tensor, summed: torch.Tensor | None, pdl: bool) -> None:
    # summed is an output buffer rather than a return value because without delta it is x itself,
    # and a custom op may not return an alias of its input.
    cols = x.shape[-1]
    if runs_triton(x):
        add_rms_norm_forward(x.reshape(-1, cols), None if delta is None else delta.reshape(-1, cols), weight, eps,
                             normed.view(-1, cols), None if summed is None else summed.view(-1, cols), pdl)
    else:
        ref_normed, ref_summed = add_rms_norm_ref(x, delta, weight, eps)
        normed.copy_(ref_normed)
        if summed is not None:
            summed.copy_(ref_summed)


@_add_rms_norm_op.register_fake
def _(x, delta, weight, eps, normed, summed, pdl) -> None:
    return None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then the decoder's RMSNorm, in one pass: returns (normed, summed).

    x [..., N] and delta [..., N] (or None) in bf16 / fp16 / fp32, weight [N] in x.dtype. summed = x + delta
    as torch adds (x itself, not a copy, when delta is None); normed = weight * (summed.float() *
    rsqrt(mean(summed.float()^2) + eps)).to(x.dtype). Both outputs are new contiguous [..., N] tensors.
    pdl: launch with programmatic dependent launch where the device supports it (KernelConfig.pdl).
    """
    op = "add_rms_norm"
    _check_float(op, "x", x)
    cols = x.shape[-1]
    if not 1 <= cols <= MAX_NORM_DIM:
        raise ValueError(f"{op}: x last dim is {cols}; the kernel normalises rows of 1..{MAX_NORM_DIM} "
                         "elements, split the hidden dim or raise MAX_NORM_DIM with a looped kernel")
    if delta is not None:
        if delta.shape != x.shape:
            raise ValueError(f"{op}: delta shape {tuple(delta.shape)} differs from x shape {tuple(x.shape)}; "
                             "pass the residual branch output of the same tokens")
        _check_like(op, "delta", delta, "x", x)
    if weight.shape != (cols,):
        raise ValueError(f"{op}: weight shape {tuple(weight.shape)} does not match x last dim {cols}; "
                         f"expected [{cols}]")
    _check_like(op, "weight", weight, "x", x)
    normed = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    summed = None if delta is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _add_rms_norm_op(x, delta, weight, float(eps), normed, summed, pdl)
    return normed, (x if summed is None else summed)


# ----------------------------------------------------------------------------------------------------------
# rope_qkv_to_cache


@triton.jit
def _rope_qkv_to_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, positions_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    stride_xb, stride_xt, stride_cb, stride_ct, stride_sb, stride_st, stride_pb, stride_pt,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    T,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    SOFT_BF16: tl.constexpr, FP8_CACHE: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):
    """Program (token, head block): heads index the H_q + 2 H_kv heads of the qkv row (q, then k, then v)."""
    gdc_wait_if(USE_GDC)
    gdc_launch_if(USE_GDC)
    token = tl.program_id(0)
    b = (token // T).to(tl.int64)
    t = (token % T).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF)
    head_ok = heads < NUM_HEADS + 2 * NUM_KV_HEADS
    x_first = qkv_ptr + b * stride_xb + t * stride_xt + heads[:, None] * (2 * HALF) + offs[None, :]
    x1 = tl.load(x_first, mask=head_ok[:, None], other=0.0)  # [BLOCK_H, HALF]: first half of each head
    x2 = tl.load(x_first + HALF, mask=head_ok[:, None], other=0.0)
    cos = tl.load(cos_ptr + b * stride_cb + t * stride_ct + offs)[None, :]
    sin = tl.load(sin_ptr + b * stride_sb + t * stride_st + offs)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    rot1 = _round_to(x1f * cos - x2f * sin, x1.dtype, SOFT_BF16)
    rot2 = _round_to(x2f * cos + x1f * sin, x1.dtype, SOFT_BF16)

    is_q = heads < NUM_HEADS
    q_rows = (token.to(tl.int64) * NUM_HEADS + heads) * (2 * HALF)  # q_out [B, T, H_q, D] contiguous
    q_first = q_ptr + q_rows[:, None] + offs[None, :]
    tl.store(q_first, rot1, mask=is_q[:, None])
    tl.store(q_first + HALF, rot2, mask=is_q[:, None])

    position = tl.load(positions_ptr + b * stride_pb + t * stride_pt).to(tl.int64)
    kv_head = heads - NUM_HEADS
    is_k = (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    k_head = tl.minimum(tl.maximum(kv_head, 0), NUM_KV_HEADS - 1).to(tl.int64)  # keep masked addresses in range
    k_first = k_cache_ptr + (b * stride_kb + k_head * stride_kh + position * stride_ks)[:, None] + offs[None, :]
    tl.store(k_first, store_cast(rot1, FP8_CACHE, k_cache_ptr.dtype.element_ty), mask=is_k[:, None])
    tl.store(k_first + HALF, store_cast(rot2, FP8_CACHE, k_cache_ptr.dtype.element_ty), mask=is_k[:, None])

    v_head = kv_head - NUM_KV_HEADS
    is_v = (v_head >= 0) & head_ok
    v_head = tl.minimum(tl.maximum(v_head, 0), NUM_KV_HEADS - 1).to(tl.int64)
    v_first = v_cache_ptr + (b * stride_vb + v_head * stride_vh + position * stride_vs)[:, None] + offs[None, :]
    tl.store(v_first, store_cast(x1, FP8_CACHE, v_cache_ptr.dtype.element_ty), mask=is_v[:, None])
    tl.store(v_first + HALF, store_cast(x2, FP8_CACHE, v_cache_ptr.dtype.element_ty), mask=is_v[:, None])


def rope_qkv_to_cache_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                              q_out: torch.Tensor, pdl: bool = False) -> None:
    """Launch the rotary-embedding + cache-write kernel (inputs already validated).

    Launch contract:
      qkv:       [B, T, (H_q + 2 H_kv) * D] bf16 / fp16 / fp32, last dim contiguous, any other strides
      cos, sin:  fp32 [B, T, D/2], last dim contiguous (the tables gathered at the positions)
      k_cache, v_cache: [B, H_kv, S_max, D] qkv.dtype or float8_e4m3fn (stored saturated, plugins/kv_dtype.py),
                 last dim contiguous, any other strides (written
                 at [b, :, positions[b, t], :] only)
      positions: int32 / int64 [B, T], values in [0, S_max) (not checked: that would need a host sync)
      q_out:     [B, T, H_q, D] qkv.dtype, contiguous (written)
      grid:      (B * T, cdiv(H_q + 2 H_kv, BLOCK_H)); a program rotates BLOCK_H heads of one token and
                 stores each where its kind goes (q -> q_out, k -> k_cache, v -> v_cache unrotated)
      pdl:       programmatic dependent launch where pdl_supported
    """
    batch, t = qkv.shape[:2]
    head_dim = q_out.shape[-1]
    total_heads = num_heads + 2 * num_kv_heads
    if batch * t == 0:
        return
    choice = launch_table(qkv.device).fused_ops
    block_h = min(triton.next_power_of_2(total_heads), max(1, choice.rope_tile // head_dim))
    grid = (batch * t, triton.cdiv(total_heads, block_h))
    _rope_qkv_to_cache_kernel[grid](
        qkv, cos, sin, positions, q_out, k_cache, v_cache,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        t,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, BLOCK_H=block_h,
        SOFT_BF16=_soft_bf16(), FP8_CACHE=is_fp8(k_cache.dtype), num_warps=choice.rope_num_warps,
        enable_fp_fusion=False,
        **gdc_args(pdl and pdl_supported(qkv.device)),
    )


@torch.library.custom_op("trtllm_dustin::rope_qkv_to_cache", mutates_args=("k_cache", "v_cache"))
def _rope_qkv_to_cache_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int, pdl: bool) -> torch.Tensor:
    if runs_triton(qkv):
        q_out = torch.empty(*qkv.shape[:2], num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
        rope_qkv_to_cache_forward(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, q_out, pdl)
        return q_out
    return rope_qkv_to_cache_ref(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, head_dim)


@_rope_qkv_to_cache_op.register_fake
def _(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, head_dim, pdl) -> torch.Tensor:
    return qkv.new_empty(*qkv.shape[:2], num_heads, head_dim)


def _check_rope_inputs(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, head_dim) -> None:
    op = "rope_qkv_to_cache"
    if qkv.dim() != 3:
        raise ValueError(f"{op}: qkv has shape {tuple(qkv.shape)}; expected 3 dims [B, T, (H_q + 2 H_kv) * D]")
    _check_float(op, "qkv", qkv)
    batch, t, width = qkv.shape
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"{op}: head_dim {head_dim} is not supported; use one of {_HEAD_DIMS}")
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"{op}: num_heads {num_heads} and num_kv_heads {num_kv_heads} must both be >= 1")
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"{op}: qkv last dim is {width} but (num_heads {num_heads} + 2 * num_kv_heads "
                         f"{num_kv_heads}) * head_dim {head_dim} = {(num_heads + 2 * num_kv_heads) * head_dim}; "
                         "pass the fused q|k|v projection output and the model's head counts")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (batch, t, head_dim // 2) or table.dtype != torch.float32:
            raise ValueError(f"{op}: {name} is {table.dtype} {tuple(table.shape)}; expected float32 "
                             f"[{batch}, {t}, {head_dim // 2}] (the table rows gathered at the positions)")
        if table.device != qkv.device or table.stride(-1) != 1:
            raise ValueError(f"{op}: {name} is on {table.device} with last-dim stride {table.stride(-1)}; "
                             f"it must be on {qkv.device} with a contiguous last dim")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[0] != batch or cache.shape[1] != num_kv_heads \
                or cache.shape[3] != head_dim:
            raise ValueError(f"{op}: {name} has shape {tuple(cache.shape)}; expected [{batch}, {num_kv_heads}, "
                             f"S_max, {head_dim}] (index the layer out of a [n_layers, B, H_kv, S_max, D] buffer)")
        _check_like(op, name, cache, "qkv", qkv, fp8_ok=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}; pass the same layer's K and V")
    if positions.shape != (batch, t) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: positions is {positions.dtype} {tuple(positions.shape)}; expected int64 or "
                         f"int32 [{batch}, {t}] (cache position of each new token)")
    if positions.device != qkv.device:
        raise ValueError(f"{op}: positions is on {positions.device} but qkv is on {qkv.device}")
    if k_cache.shape[2] < t:
        raise ValueError(f"{op}: the caches hold {k_cache.shape[2]} positions, fewer than the {t} new tokens; "
                         "allocate a longer cache")


def rope_qkv_to_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, *, pdl: bool = False) -> torch.Tensor:
    """Rotary embedding of the fused q|k|v projection plus the KV-cache write, in one pass.

    qkv [B, T, (H_q + 2 H_kv) * D]; cos, sin fp32 [B, T, D/2] (already at the positions); caches
    [B, H_kv, S_max, D] (any strides but the last); positions int64 / int32 [B, T]. Rotates q and k with the
    half-split layout in fp32, writes k and v to cache[b, :, positions[b, t]] and returns the rotated
    q [B, T, H_q, D] (new, contiguous). Positions must lie in [0, S_max) and be distinct within a sequence;
    they are not checked, since reading them would stall the host (and break CUDA-graph capture). Caches may be
    float8_e4m3fn: k and v are then stored saturated at +-448 and rounded as torch's cast rounds (plugins/kv_dtype.py).
    pdl: launch with programmatic dependent launch where the device supports it (KernelConfig.pdl).
    """
    _check_rope_inputs(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, head_dim)
    return _rope_qkv_to_cache_op(qkv, cos, sin, k_cache, v_cache, positions, num_heads, num_kv_heads, head_dim, pdl)


# ----------------------------------------------------------------------------------------------------------
# silu_mul


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr,
                     SOFT_BF16: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_wait_if(USE_GDC)
    gdc_launch_if(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=col_ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=col_ok, other=0.0)
    gate_f = gate.to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in fp32, rounded to the input dtype; div_rn because `/` is approximate.
    silu = _round_to(tl.math.div_rn(gate_f, 1.0 + tl.exp(-gate_f)), gate.dtype, SOFT_BF16)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _round_to(out, gate.dtype, SOFT_BF16), mask=col_ok)


def silu_mul_forward(gate_up: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> None:
    """Launch the SiLU-and-mul kernel (inputs already validated).

    Launch contract:
      gate_up: [M, 2I] bf16 / fp16 / fp32, last dim contiguous, any row stride; gate = [:, :I], up = [:, I:]
      out:     [M, I] gate_up.dtype, last dim contiguous (written): silu(gate) * up rounded as torch does
      grid:    (M, cdiv(I, silu_block)); a program covers silu_block columns of one row (launch.py: 1024)
      pdl:     programmatic dependent launch where pdl_supported
    """
    rows, inter = out.shape
    if rows == 0:
        return
    choice = launch_table(out.device).fused_ops
    _silu_mul_kernel[(rows, triton.cdiv(inter, choice.silu_block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter,
        BLOCK=choice.silu_block, SOFT_BF16=_soft_bf16(), num_warps=choice.silu_num_warps, enable_fp_fusion=False,
        **gdc_args(pdl and pdl_supported(gate_up.device)),
    )


@torch.library.custom_op("trtllm_dustin::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor, pdl: bool) -> torch.Tensor:
    if not runs_triton(gate_up):
        return silu_mul_ref(gate_up).contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, device=gate_up.device, dtype=gate_up.dtype)
    silu_mul_forward(gate_up.reshape(-1, 2 * inter), out.view(-1, inter), pdl)
    return out


@_silu_mul_op.register_fake
def _(gate_up, pdl) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul(gate_up: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """SwiGLU's activation: gate_up [..., 2I] (gate first) -> F.silu(gate) * up [..., I], new and contiguous.
    pdl: launch with programmatic dependent launch where the device supports it (KernelConfig.pdl)."""
    op = "silu_mul"
    _check_float(op, "gate_up", gate_up)
    if gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: gate_up last dim is {gate_up.shape[-1]}, not even; pass the fused [gate | up] "
                         "projection output of width 2 * intermediate_size")
    return _silu_mul_op(gate_up, pdl)
