"""Train a ring drafter (trtllm_dustin/models/ring_drafter.py) against its frozen target.

Knowledge distillation on the target's own next-token distributions over train-split windows (a token file from
`trtllm-dustin prepare-distill-data`): per window the frozen target runs once, keeping its hidden states at the read
layers; the drafter's ring pass runs over the whole window (every position reading the last W), and from anchors L
every `anchor_stride` positions its slots are unrolled as they run at serving time (slot g from slot g - 1's own
output, the tokens teacher-forced). Loss: KL(target || drafter) at T = 1, the slots' mean at the anchors plus the ring
pass's mean at every `causal_stride`-th position (the ring pass is slot 0 of every position).

The recipe measured as a probe (benchmarks/results/longspark2/README.md, third run: 1,230 s on an H100, greedy-round
tau 2.99 / 4.39 at Γ = 3 / 7 against the AR draft's 3.02 / 4.52) is this command's defaults, with two differences:
norms and other one-dimensional weights get no weight decay here, and the probe warmed up over 50 steps by time.
Resumable through the loop it shares with LongSpark (training/windows.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import model_fingerprint
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.ring_drafter import (
    HEAD_IDS_FILE,
    RingDrafter,
    RingDrafterConfig,
    load_ring_weights,
    read_ring_checkpoint,
)
from trtllm_dustin.training.distill import kd_loss
from trtllm_dustin.training.longspark import target_features
from trtllm_dustin.training.windows import check_window_config, train_on_windows, write_trained

__all__ = ["RingTrainConfig", "ring_loss", "slot_logits", "train_ring_drafter"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RingTrainConfig:
    read_layers: tuple[int, ...] = (3, 9, 15, 22, 29)  # SmolLM2-135M's 30 layers (LongSpark's)
    own_layers: tuple[int, ...] = (0, 10, 20, 29)  # the copies the drafter starts from (the AR draft's init)
    window: int = 256
    block: int = 7
    causal_stride: int = 2  # ring-pass positions scored per window
    seq_len: int = 4096
    batch_size: int = 4
    anchor_stride: int = 16
    anchor_from: int = 1
    steps: int = 100000  # optimiser steps (usually bounded by max_seconds)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    init: str = ""  # a trained ring drafter to start from (read_ring_checkpoint's spec); "": copies of target layers

    def __post_init__(self) -> None:
        for name in ("read_layers", "own_layers"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.causal_stride < 1:
            raise ConfigError(f"causal_stride={self.causal_stride} must be >= 1")
        check_window_config(self)
        self.drafter("")  # the drafter's own checks

    def drafter(self, target_fingerprint: str) -> RingDrafterConfig:
        return RingDrafterConfig(self.read_layers, self.own_layers, self.window, self.block, target_fingerprint)

    def check_init(self) -> tuple[Path, RingDrafterConfig] | None:
        """With `init`: its checkpoint exists and has this run's shape (read_layers, own_layers, window, block), checked
        from its config alone, before anything loads -> its directory and config (None without `init`)."""
        if not self.init:
            return None
        directory, config = read_ring_checkpoint(self.init)
        for name in ("read_layers", "own_layers", "window", "block"):
            theirs, mine = (_option(getattr(c, name)) for c in (config, self))
            if theirs != mine:
                raise ConfigError(f"--init {self.init} has {name} {theirs}, this run {name} {mine}; pass "
                                  f"--{name.replace('_', '-')} {theirs} to continue training it")
        return directory, config


def _option(value: int | tuple[int, ...]) -> str:
    """A config value as its command-line option takes it ("0,10,20,29" for layers)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def slot_logits(model: RingDrafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
                feats: dict | None = None, correction: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every anchor's slots as proposals -> (logits [B * A, G, V] fp32, the teacher's there, the ring pass's outputs
    [B, T, H]). feats: the target_features of these windows at the read layers, if already computed; correction:
    previous tokens [B * A, G] (the true ones) -> a term added to the slots' logits (a dev variant's; None: none)."""
    read, G = model.config.read_layers, model.config.block
    feats = feats if feats is not None else target_features(target, tokens, read)
    x, slots = model.forward_train(tokens, torch.stack([feats["hidden"][layer] for layer in read], dim=2), anchors)
    slot_pos = anchors[:, None] + torch.arange(G, device=tokens.device)
    with torch.no_grad():
        teacher = target.head(feats["final"][:, slot_pos]).reshape(-1, G, target.config.vocab_size)
    logits = target.head(slots).float()
    if correction is not None:
        logits = logits + correction(tokens[:, slot_pos].reshape(-1, G))
    return logits, teacher, x


def ring_loss(model: RingDrafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
              causal_stride: int, correction: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One batch's loss: the mean KL of every anchor's slots plus the mean KL of the ring pass at every
    causal_stride-th position (correction: as slot_logits')."""
    feats = target_features(target, tokens, model.config.read_layers)
    logits, teacher, x = slot_logits(model, target, tokens, anchors, feats, correction)
    causal = torch.arange(0, tokens.shape[1] - 1, causal_stride, device=tokens.device)
    with torch.no_grad():
        teacher_causal = target.head(feats["final"][:, causal])
    return kd_loss(logits, teacher, 1.0) + kd_loss(target.head(x[:, causal]), teacher_causal, 1.0)


def train_ring_drafter(tokens_file: str | Path, out_dir: str | Path, cfg: RingTrainConfig,
                       target_spec: str | None = None, device: str = "cuda", max_seconds: float | None = None,
                       save_every: float = 60.0, plot: bool = True, stop_after: float | None = None) -> dict:
    """Train, resumably, and write out_dir/checkpoint (config.json + model.safetensors), the training record and
    the loss curve (.npy and .png)."""

    init = cfg.check_init()

    def build(target: Transformer) -> RingDrafter:
        model = RingDrafter(cfg.drafter(model_fingerprint(target.config)), target)
        if init is None:
            return model
        directory, config = init
        config.check_target(target.config)  # trained for this target
        return load_ring_weights(model, directory)  # a resumed run then loads its own state over these

    def loss(model: RingDrafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return ring_loss(model, target, tokens, anchors, cfg.causal_stride)

    model, _, common, losses = train_on_windows(tokens_file, out_dir, cfg, build, loss, "the ring drafter",
                                                target_spec, device, max_seconds, save_every,
                                                legacy={"init": ""}, stop_after=stop_after)
    record = {"schema_version": SCHEMA_VERSION, **common}
    write_trained(model, out_dir, record, losses, plot)
    if init is not None:  # the subset head it proposed from (vocabulary ids, not trained) serves the continued one too
        head = init[0] / HEAD_IDS_FILE
        if head.is_file():
            shutil.copyfile(head, Path(out_dir) / "checkpoint" / HEAD_IDS_FILE)
    return record
