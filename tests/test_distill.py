"""Draft distillation: the loss is a KL divergence, training lowers it, and the checkpoint loads back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.models import ModelLoadError, load_model
from trtllm_dustin.training.distill import DistillConfig, frequent_ids, kd_loss, train_draft


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


def test_frequent_ids_rank_by_count_then_id_and_keep_forced_ids() -> None:
    data = np.array([[5, 5, 5, 3, 3, 7, 7, 1, 9, 9]], dtype=np.uint16)  # counts: 5:3, 3:2, 7:2, 9:2, 1:1
    assert frequent_ids(data, 3, 12).tolist() == [3, 5, 7]  # 5, then the ties 3 < 7 < 9 by id
    assert frequent_ids(data, 3, 12, always=[11]).tolist() == [3, 5, 11]  # 11 never occurs but is forced


def test_weight_and_kv_bytes_per_token_by_hand() -> None:
    c = ModelConfig(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                    intermediate_size=16, tie_word_embeddings=False, head_vocab_size=10)
    block = 8 * 4 * (2 * 2 + 1 * 2) + 3 * 8 * 16 + 2 * 8  # q, o, k, v; SwiGLU; two norms
    assert c.weight_bytes_per_token(2) == 2 * (2 * block + 10 * 8 + 8)  # blocks, 10 output rows, final norm
    assert c.num_parameters() == 2 * block + (100 + 10) * 8 + 8
    assert c.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2
    with pytest.raises(ConfigError, match="tie_word_embeddings=False"):
        c.with_(tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="head_vocab_size=100"):
        c.with_(head_vocab_size=100)


def test_layer_subset_draft_shares_the_target_embedding_and_predicts_its_head_ids(tmp_path) -> None:
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 60, size=(64, 1))  # ids 0..91 only: a 64-row head covers most of them
    np.save(tmp_path / "tokens.npy", (starts + np.arange(33) % 32).astype(np.uint16))
    cfg = DistillConfig(seq_len=32, batch_size=8, steps=40, lr=3e-3, warmup=4, init_layers=(0, 2), head_vocab=64)
    record = train_draft(tmp_path / "tokens.npy", tmp_path / "out", cfg, target_spec="preset:tiny-llama",
                         device="cpu", plot=False)
    curve = np.load(tmp_path / "out" / "loss_curve.npy")
    assert curve[-5:].mean() < curve[:3].mean()
    target = load_model("preset:tiny-llama").model
    ckpt = tmp_path / "out" / "checkpoint"
    from safetensors import safe_open

    stored = set()
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            stored |= set(handle.keys())
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & stored and "dustin.head_ids" in stored
    with pytest.raises(ModelLoadError, match="share_with"):
        load_model(str(ckpt))
    draft = load_model(str(ckpt), share_with=target).model
    assert draft.config.num_layers == 2 and draft.config.head_vocab_size == 64
    expected_ids = frequent_ids(np.load(tmp_path / "tokens.npy"), 64, 257, always=target.config.eos_token_ids)
    assert draft.head_ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(draft.embed.weight, target.embed.weight)
    torch.testing.assert_close(draft.lm_head.weight, target.output_weight()[draft.head_ids])
    assert record["weight_bytes_per_token"]["ratio"] > 1 and record["kv_bytes_per_token"]["ratio"] == 1.5
    # Logits over the whole vocabulary: -inf outside the head, the head's rows inside.
    from trtllm_dustin.attention import AttentionMetadata, get_backend
    from trtllm_dustin.kv_cache import KVCache

    tokens = torch.tensor([[3, 4, 5, 6]])
    cache = KVCache.allocate(draft.config, 1, 8, torch.float32, "cpu")
    meta = AttentionMetadata(cache_seqlens=torch.zeros(1, dtype=torch.int32), max_kv_len=8)
    logits = draft(tokens, cache, meta, get_backend("reference"))
    outside = torch.ones(257, dtype=torch.bool)
    outside[draft.head_ids] = False
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., draft.head_ids]).all()
    torch.testing.assert_close(logits[..., draft.head_ids], draft.forward_train(tokens))
