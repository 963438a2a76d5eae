"""Rotary position embeddings with the context-extension schemes the model family uses.

- default: theta^(-2i/d)
- llama3: Llama 3.1/3.2 piecewise scaling (low frequencies divided by `factor`, high kept, smooth in between)
- yarn: Qwen2.5's recommended extension to 64K/128K (per-dimension ramp between interpolation and
  extrapolation, plus a logit temperature folded into cos/sin)
- linear: positions divided by `factor`
"""

from __future__ import annotations

import math

import torch

from trtllm_dustin.config import ModelConfig, RopeScaling

__all__ = ["apply_rope", "inverse_frequencies", "rope_tables"]


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the dimension rotates fast enough to extrapolate
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1 / (s.factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv_freq, attention_factor


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Per-pair rotary frequencies [head_dim // 2] (float32, as the checkpoints compute them) and the cos/sin factor."""
    dim, base, s = config.head_dim, config.rope_theta, config.rope_scaling
    if s.rope_type == "yarn":
        return _yarn(dim, base, s)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if s.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, s)
    elif s.rope_type == "linear":
        inv_freq = inv_freq / s.factor
    return inv_freq, 1.0


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim // 2] in float32, indexed by absolute position."""
    inv_freq, scale = inverse_frequencies(config)
    # Computed in float32 like the reference implementations, so that long positions round the same way.
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] with cos/sin [B, T, D/2] (the half-split layout of Hugging Face checkpoints)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
