"""Training data the target wrote (training/regenerate.py, `trtllm-dustin regenerate-data`) and LongSpark's
position-weighted loss: each window keeps its context and continues with exactly what the runtime's vanilla
decoder samples from the target with batch b's seed; an interrupted run resumes to the same file; bad input is
refused before the target loads; the slot weights follow position_decay ** g."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trtllm_dustin.attention import get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.training import regenerate
from trtllm_dustin.training.regenerate import RegenerateConfig, regenerate_tokens

pytestmark = pytest.mark.usefixtures("plugin_references")
TARGET = "preset:tiny-llama"
CFG = RegenerateConfig(context=24, new=10, temperature=0.7, top_p=0.8, batch_size=2, seed=3)


def _tokens(tmp_path, windows: int = 5, length: int = 40):
    data = np.random.default_rng(1).integers(2, 257, size=(windows, length)).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", data)
    return data


def _expected(data: np.ndarray) -> np.ndarray:
    """What the runtime's vanilla decoder samples after each window's context, batch b from seed 3 + b."""
    target = load_model(TARGET, dtype=torch.float32, max_positions=CFG.context + CFG.new + 16).model
    decoder = build_decoder("vanilla", MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, 2, CFG.context + CFG.new + 16, torch.float32,
                                                     "cpu"), backend=get_backend("reference"), use_cuda_graph=False))
    rows = []
    for b, start in enumerate(range(0, len(data), 2)):
        prompts = [data[i, : CFG.context].astype(np.int64).tolist() for i in range(start, min(start + 2, len(data)))]
        out = decoder.generate(prompts, GenerationConfig(CFG.new, SamplingParams(0.7, 0.8, 3 + b))).tokens
        rows += [p + o for p, o in zip(prompts, out, strict=True)]
    return np.asarray(rows, dtype=np.uint16)


def test_each_window_keeps_its_context_and_continues_with_the_targets_samples(tmp_path) -> None:
    data = _tokens(tmp_path)
    record = regenerate_tokens(tmp_path / "tokens.npy", tmp_path / "regen.npy", CFG, TARGET, device="cpu")
    got = np.load(tmp_path / "regen.npy")
    assert got.shape == (5, 34) and got.dtype == np.uint16 and record["shape"] == [5, 34]
    assert np.array_equal(got[:, :24], data[:, :24])
    assert not np.array_equal(got[:, 24:], data[:, 24:34])  # the tails are the target's, not the corpus's
    assert np.array_equal(got, _expected(data))
    assert json.loads((tmp_path / "regen.json").read_text())["temperature"] == 0.7
    assert not (tmp_path / "regen.partial.npy").exists() and not (tmp_path / "regen.progress.json").exists()


def test_an_interrupted_run_resumes_to_the_same_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _tokens(tmp_path)
    real = Decoder.generate
    calls = []

    def dies_after_two_batches(self, prompts, config, profile=False):
        calls.append(len(prompts))
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(self, prompts, config, profile)

    monkeypatch.setattr(Decoder, "generate", dies_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        regenerate_tokens(tmp_path / "tokens.npy", tmp_path / "regen.npy", CFG, TARGET, device="cpu")
    assert not (tmp_path / "regen.npy").exists()  # no half-written output under the final name
    assert json.loads((tmp_path / "regen.progress.json").read_text())["rows_done"] == 4
    monkeypatch.setattr(Decoder, "generate", real)
    with pytest.raises(ConfigError, match="other settings"):
        regenerate_tokens(tmp_path / "tokens.npy", tmp_path / "regen.npy", RegenerateConfig(**{**CFG.__dict__,
                          "seed": 4}), TARGET, device="cpu")
    regenerate_tokens(tmp_path / "tokens.npy", tmp_path / "regen.npy", CFG, TARGET, device="cpu")
    assert np.array_equal(np.load(tmp_path / "regen.npy"), _expected(data))


def test_bad_input_is_refused_before_the_target_loads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tokens(tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("trtllm_dustin.models.loading.load_model", no_loading)
    src = tmp_path / "tokens.npy"
    with pytest.raises(ConfigError, match="fewer than context=41"):
        regenerate_tokens(src, tmp_path / "a.npy", RegenerateConfig(context=41), TARGET, device="cpu")
    with pytest.raises(ConfigError, match="more than the target's 2048 positions"):
        regenerate_tokens(src, tmp_path / "a.npy", RegenerateConfig(context=24, new=2100), TARGET, device="cpu")
    with pytest.raises(ConfigError, match="does not exist"):
        regenerate_tokens(tmp_path / "none.npy", tmp_path / "a.npy", CFG, TARGET, device="cpu")
    (tmp_path / "a.npy").write_bytes(b"")
    with pytest.raises(ConfigError, match="exists; choose another file"):
        regenerate_tokens(src, tmp_path / "a.npy", CFG, TARGET, device="cpu")
    with pytest.raises(ConfigError, match="top_p=0"):
        RegenerateConfig(context=4, top_p=0)
    assert regenerate.RegenerateConfig is RegenerateConfig


def test_the_loss_weighs_slot_g_by_position_decay_to_the_g(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_dustin.models.longspark import random_longspark
    from trtllm_dustin.training import longspark as training

    target = load_model(TARGET, dtype=torch.float64, seed=7).model
    spark = random_longspark(target, seed=3, window=8, summary=4, block=4)
    tokens = torch.tensor([[5 + (i * 11) % 240 for i in range(40)]])
    anchors = torch.tensor([6, 20, 30])
    base, teacher, previous = training.anchor_logits(spark, target, tokens, anchors)
    t = torch.log_softmax(teacher, -1)
    kl = (t.exp() * (t - torch.log_softmax(base + spark.markov_all(previous), -1))).sum(-1)  # [A, G]
    assert torch.allclose(training.step_loss(spark, target, tokens, anchors), kl.mean())
    weights = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=kl.dtype)
    want = (kl * weights).sum(-1).mean() / weights.sum()
    assert torch.allclose(training.step_loss(spark, target, tokens, anchors, 0.5), want)
    assert not torch.allclose(want, kl.mean())
    with pytest.raises(ConfigError, match="position_decay=0 must be in"):
        training.LongSparkTrainConfig(position_decay=0)


def test_anchors_start_where_asked_and_keep_their_stride() -> None:
    from trtllm_dustin.training.longspark import LongSparkTrainConfig, anchor_positions

    whole = LongSparkTrainConfig(seq_len=64, block=4, anchor_stride=8)
    assert anchor_positions(whole, 3).tolist() == [3, 11, 19, 27, 35, 43, 51, 59]  # as before the option
    tail = LongSparkTrainConfig(seq_len=64, block=4, anchor_stride=8, anchor_from=40)
    assert anchor_positions(tail, 1).tolist() == [40, 48, 56]
    assert anchor_positions(LongSparkTrainConfig(seq_len=64, block=4, anchor_stride=8, anchor_from=58), 8).tolist() \
        == [60]  # the offset passed them all: the last anchor the window has
    with pytest.raises(ConfigError, match="anchor_from=61 must be in \\[1, seq_len - block = 60\\]"):
        LongSparkTrainConfig(seq_len=64, block=4, anchor_from=61)
