"""Draft distillation: the loss is a KL divergence, training lowers it, and the checkpoint loads back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.distill import DistillConfig, kd_loss, train_draft
from trtllm_dustin.models import load_model


def test_kd_loss_is_the_kl_divergence() -> None:
    torch.manual_seed(0)
    t, s = torch.randn(3, 5, 11), torch.randn(3, 5, 11)
    p, q = torch.softmax(t / 2, -1), torch.softmax(s / 2, -1)
    expected = (p * (p.log() - q.log())).sum(-1).mean() * 4
    torch.testing.assert_close(kd_loss(s, t, 2.0), expected)
    assert kd_loss(t, t, 1.0).abs() < 1e-6


def test_training_lowers_the_loss_and_writes_a_loadable_draft(tmp_path) -> None:
    rng = np.random.default_rng(0)
    # A learnable stream: each window counts upwards modulo the vocabulary from a random start.
    starts = rng.integers(0, 257, size=(64, 1))
    np.save(tmp_path / "tokens.npy", ((starts + np.arange(33)) % 257).astype(np.uint16))
    cfg = DistillConfig(draft_shape="tiny-llama-draft", seq_len=32, batch_size=8, steps=60, lr=3e-3, warmup=5)
    record = train_draft(tmp_path / "tokens.npy", tmp_path / "out", cfg, target_spec="preset:tiny-llama",
                         device="cpu", plot=False)
    curve = np.load(tmp_path / "out" / "loss_curve.npy")
    assert len(curve) == 60 and curve[-10:].mean() < 0.7 * curve[:5].mean()
    assert json.loads((tmp_path / "out" / "training_record.json").read_text())["final_loss"] == record["final_loss"]
    draft = load_model(str(tmp_path / "out" / "checkpoint")).model
    assert draft.config.num_layers == 2 and draft.config.vocab_size == 257


def test_windows_shorter_than_seq_len_are_refused(tmp_path) -> None:
    np.save(tmp_path / "tokens.npy", np.zeros((4, 16), dtype=np.uint16))
    with pytest.raises(ConfigError, match="fewer than seq_len=32"):
        train_draft(tmp_path / "tokens.npy", tmp_path / "out", DistillConfig(seq_len=32, steps=2, warmup=1),
                    target_spec="preset:tiny-llama", device="cpu", plot=False)
