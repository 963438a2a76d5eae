"""Train a LongSpark drafter (trtllm_dustin/models/longspark.py) against its frozen target.

Knowledge distillation on the target's own next-token distributions over train-split windows (a token file from
`trtllm-dustin prepare-distill-data`, the same as the autoregressive draft's): per window of T tokens the frozen
target runs once, keeping its K/V and hidden states at the selected layers; then A anchors L per window (every
`anchor_stride` positions from a random offset, as the paper samples many anchors per sequence) each build a
drafter block exactly as the runtime does at L (boundary state at L - 1, window rows [L - W, L), summary over rows
[0, L), slot 0 = token L), and slot i is matched to the target's distribution at position L + i, with the true
token at L + i as the Markov correction's previous token (teacher forcing). Loss: KL(target || drafter), mean over
slots (slot i weighted by position_decay ** i when that is below 1), at T = 1. The token file may be one the target
wrote (`trtllm-dustin regenerate-data`, training/regenerate.py).

Resumable (training/windows.py, the loop it shares with the ring drafter): `resume.pt` in the output directory is
written every `save_every` seconds and at the end; a run with the same directory and config continues from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import model_fingerprint
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.models.longspark import LongSpark, LongSparkConfig, window_rows
from trtllm_dustin.training.windows import anchor_positions, check_window_config, train_on_windows, write_trained

__all__ = ["LongSparkTrainConfig", "anchor_logits", "anchor_positions", "anchor_summaries", "step_loss",
           "target_features", "train_longspark"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LongSparkTrainConfig:
    target_layers: tuple[int, ...] = (3, 9, 15, 22, 29)  # SmolLM2-135M's 30 layers; 9 is its searched SRH layer
    window: int = 256
    summary: int = 16
    block: int = 7
    lora_rank: int = 32
    fuse_rank: int = 128
    markov_rank: int = 16
    seq_len: int = 4096  # tokens per training window
    batch_size: int = 4  # windows per step
    anchor_stride: int = 16  # anchors every this many positions (4096 / 16 = 256 per window)
    steps: int = 100000  # optimiser steps (usually bounded by max_seconds)
    lr: float = 1e-3  # peak AdamW learning rate (the packaged drafter's; the paper used 6e-4), cosine decay
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # Slot g's share of the loss grows as position_decay ** g: acceptance is a prefix product, so an early slot's
    # error costs every later one; 1.0 weighs the slots alike
    position_decay: float = 1.0
    # Anchors only at positions >= anchor_from: on windows from `regenerate-data`, the part the target wrote (its
    # --context); 1: the whole window
    anchor_from: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        check_window_config(self)
        if not 0 < self.position_decay <= 1:
            raise ConfigError(f"position_decay={self.position_decay} must be in (0, 1]")

    def drafter(self, target_fingerprint: str) -> LongSparkConfig:
        return LongSparkConfig(self.target_layers, self.window, self.summary, self.block, self.lora_rank,
                               self.fuse_rank, self.markov_rank, target_fingerprint)


@torch.no_grad()
def target_features(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...], queries: bool = False
                    ) -> dict:
    """The frozen target over whole windows tokens [B, T] (causal, positions 0..T-1; `Transformer.run_whole`, the
    inference forward in its training mode): per selected layer its rotated keys and values [B, H_kv, T, D] and its
    block outputs [B, T, H] (and with `queries` its rotated queries [B, H_q, T, D]); and the final hidden states
    [B, T, H] (before the norm), from which the teacher's logits at any position follow."""
    B, T = tokens.shape
    c, dtype = target.config, target.embed.weight.dtype
    capture = QueryCapture(
        layers if queries else (),
        {i: torch.empty(B, T, c.num_heads, c.head_dim, dtype=dtype, device=tokens.device) for i in layers}
        if queries else {},
        {i: torch.empty(B, T, c.hidden_size, dtype=dtype, device=tokens.device) for i in layers})
    final, kv = target.run_whole(tokens, capture)
    return {"keys": {i: kv.k[i] for i in layers}, "values": {i: kv.v[i] for i in layers}, "hidden": capture.hidden,
            "final": final, "queries": {i: q.transpose(1, 2) for i, q in capture.queries.items()}}


def anchor_summaries(scores: torch.Tensor, values: torch.Tensor, anchors: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every anchor's summary from scratch, differentiably: scores [B, H, R, T] (the summary queries' logits against
    a window's keys), values [B, H, T, D], anchors [A] (each summarises rows [0, L)) -> (o [B, A, H, R, D],
    lse [B, A, H, R]). Prefix sums under one per-query shift (the maximum over the window)."""
    lse_prefix = torch.logcumsumexp(scores, dim=-1)  # [B, H, R, T]
    shift = scores.detach().amax(dim=-1, keepdim=True)
    weights = torch.exp((scores - shift).clamp(min=-80.0))  # clamped: far-below-max rows count as ~0, never NaN
    numer = torch.cumsum(weights[..., None] * values[:, :, None], dim=-2)  # [B, H, R, T, D]
    denom = torch.cumsum(weights, dim=-1)  # [B, H, R, T]
    last = anchors - 1
    o = numer[:, :, :, last] / denom[:, :, :, last, None]  # [B, H, R, A, D]
    return o.permute(0, 3, 1, 2, 4), lse_prefix[..., last].permute(0, 3, 1, 2)


def anchor_logits(model: LongSpark, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
                  capture: dict[int, torch.Tensor] | None = None, feats: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every anchor's drafter block over windows tokens [B, T], built as the runtime builds it at L = anchor
    (ascending, 1 <= L <= T - G) -> (base logits, teacher logits [B * A, G, V] fp32, previous tokens [B * A, G]).
    capture: block -> [B * A, G', H_q, D] buffers for the blocks' rotated queries (the lookahead); feats: the
    target_features of these windows, if already computed."""
    cfg, G = model.config, model.config.block
    B, A = tokens.shape[0], anchors.shape[0]
    feats = feats if feats is not None else target_features(target, tokens, cfg.target_layers)
    slot_positions = anchors[:, None] + torch.arange(G, device=tokens.device)  # [A, G]: L .. L + G - 1
    with torch.no_grad():
        final = feats["final"][:, slot_positions]  # [B, A, G, H]
        teacher = target.head(final)
    boundary = torch.stack([feats["hidden"][layer][:, anchors - 1] for layer in cfg.target_layers], dim=2)
    seq = torch.arange(B, device=tokens.device).repeat_interleave(A)  # block n = (window n // A, anchor n % A)
    lengths = anchors[None].expand(B, -1).reshape(B * A)
    windows, sum_o, sum_lse = [], [], []
    for j, layer in enumerate(cfg.target_layers):
        k, v = feats["keys"][layer], feats["values"][layer]
        windows.append((window_rows(k, seq, lengths, cfg.window)[0], *window_rows(v, seq, lengths, cfg.window)))
        o, lse = anchor_summaries(model.summary_scores(j, k), v.float(), anchors)  # [B, A, H, R, D], [B, A, H, R]
        sum_o.append(o.reshape(B * A, *o.shape[2:]))
        sum_lse.append(lse.reshape(B * A, *lse.shape[2:]))
    cur = tokens[:, anchors].reshape(B * A)
    hidden = model.backbone(cur, lengths, boundary.reshape(B * A, *boundary.shape[2:]), windows,
                            torch.stack(sum_o, dim=1), torch.stack(sum_lse, dim=1), capture)
    previous = tokens[:, slot_positions].reshape(B * A, G)  # slot i's previous token: the true one at L + i
    return model.base_logits(hidden), teacher.reshape(B * A, G, -1), previous


def step_loss(model: LongSpark, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
              position_decay: float = 1.0) -> torch.Tensor:
    """The distillation loss of one batch of windows: KL(target || drafter) at every anchor's G slots, the Markov
    correction teacher-forced; slot g weighted by position_decay ** g (the weights' mean is 1: with 1.0, the mean
    over slots)."""
    base, teacher, previous = anchor_logits(model, target, tokens, anchors)
    student = base + model.markov_all(previous)
    t = F.log_softmax(teacher, dim=-1)
    s = F.log_softmax(student, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)  # [..., G]
    if position_decay == 1.0:
        return kl.mean()
    weights = position_decay ** torch.arange(kl.shape[-1], device=kl.device, dtype=kl.dtype)
    return (kl * (weights / weights.mean())).mean()


def train_longspark(tokens_file: str | Path, out_dir: str | Path, cfg: LongSparkTrainConfig,
                    target_spec: str | None = None, device: str = "cuda", max_seconds: float | None = None,
                    save_every: float = 60.0, plot: bool = True, stop_after: float | None = None) -> dict:
    """Train, resumably, and write out_dir/checkpoint (config.json + model.safetensors), the training record, the
    loss curve (.npy and .png). max_seconds bounds this run's training time (the cosine follows it)."""

    def build(target: Transformer) -> LongSpark:
        return LongSpark(cfg.drafter(model_fingerprint(target.config)), target)

    def loss(model: LongSpark, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return step_loss(model, target, tokens, anchors, cfg.position_decay)

    # runs from before these fields: slots weighed alike, anchors over the whole window
    model, target, common, losses = train_on_windows(
        tokens_file, out_dir, cfg, build, loss, "LongSpark", target_spec, device, max_seconds, save_every,
        legacy={"position_decay": 1.0, "anchor_from": 1}, stop_after=stop_after)
    record = {"schema_version": SCHEMA_VERSION, **common, "target_layers": list(cfg.target_layers)}
    write_trained(model, out_dir, record, losses, plot)
    return record
