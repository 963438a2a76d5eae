"""trtllm_dustin/models/ring_drafter.py: the band pass against dense attention, and the serving path (ingest the
committed positions a round at a time, then step the slots) against the training path, on the tiny preset (CPU,
float64)."""

from __future__ import annotations

import pytest
import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import load_model
from trtllm_dustin.models.ring_drafter import RingDrafter, RingDrafterConfig
from trtllm_dustin.training.longspark import target_features

READ, OWN, W, G = (0, 1), (0, 2), 6, 4


@pytest.fixture(scope="module")
def target():
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model.eval()
    model.setup_rope()
    return model


def _drafter(target, window: int = W, trained: bool = True) -> RingDrafter:
    torch.manual_seed(0)
    model = RingDrafter(RingDrafterConfig(READ, OWN, window, G), target).double().eval()
    if trained:  # F and P start at zero; give them weights so that both paths use them
        with torch.no_grad():
            model.fuse.weight.normal_(std=0.05)
            model.own.weight.normal_(std=0.05)
    return model


def _hidden(target, tokens):
    feats = target_features(target, tokens, READ)
    return torch.stack([feats["hidden"][layer] for layer in READ], dim=2)  # [B, T, R, H]


def test_the_band_pass_equals_dense_attention_over_the_last_w_positions(target) -> None:
    model = _drafter(target, window=4)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 11, h, 16, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    reference = model._attend(q, k, v, ((j <= i) & (j > i - 4))[None])
    torch.testing.assert_close(model._band(q, k, v), reference)
    assert not torch.allclose(model._band(q, k, v), model._attend(q, k, v, (j <= i)[None]))  # the band does cut


def test_untrained_slots_repeat_the_causal_pass_when_the_ring_holds_every_position(target) -> None:
    """With F = P = 0 slot g's input is its token's embedding, as the ring pass's is at L + g; with a ring as long
    as the sequence both read the same keys, so slot g's output is the ring pass's at L + g."""
    model = _drafter(target, window=32, trained=False)
    tokens = torch.randint(2, 250, (2, 14), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 6, 9])
    x, s = model.forward_train(tokens, _hidden(target, tokens), anchors)
    torch.testing.assert_close(s, x[:, anchors[:, None] + torch.arange(G)].reshape(6, G, -1))


def test_serving_a_round_at_a_time_gives_the_training_outputs(target) -> None:
    """Committed positions ingested in chunks of at most block + 1 (padded with invalid entries), the ring wrapping
    around several times (W = 6, 20 positions), and at each anchor the slots stepped from its output with the true
    tokens: every output equals forward_train's."""
    model = _drafter(target)
    T = 20
    tokens = torch.randint(2, 250, (2, T), generator=torch.Generator().manual_seed(3))
    hidden = _hidden(target, tokens)
    anchors = [5, 9, 12, 16]
    x, slots = model.forward_train(tokens, hidden, torch.tensor(anchors))
    slots = slots.reshape(2, len(anchors), G, -1)
    state = model.new_state(2)
    shifted = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)  # position p reads p - 1
    bounds = [0, 3, *[L + 1 for L in anchors], T]
    for start, end in zip(bounds, bounds[1:], strict=False):
        n = end - start
        pos = torch.arange(start, start + G + 1)  # padded to block + 1 entries
        valid = (pos < end)[None].expand(2, -1)
        take = pos.clamp(max=T - 1)  # the padding past the end reads any token: it is invalid
        out = model.ingest(state, tokens[:, take], shifted[:, take], pos[None].expand(2, -1).clone(), valid)
        torch.testing.assert_close(out[:, :n], x[:, start:end])
        L = end - 1
        if L in anchors:
            a = anchors.index(L)
            previous = out[:, n - 1]
            torch.testing.assert_close(previous, slots[:, a, 0])
            for g in range(1, G):
                previous = model.step(state, g, tokens[:, L + g], previous, torch.full((2,), L))
                torch.testing.assert_close(previous, slots[:, a, g])


def test_bad_configs_and_oversized_ingests_are_refused(target) -> None:
    with pytest.raises(ConfigError, match="do not exist"):
        RingDrafter(RingDrafterConfig((0, 5), OWN, W, G), target)
    with pytest.raises(ConfigError, match="window=0"):
        RingDrafterConfig(READ, OWN, 0, G)
    model = _drafter(target)
    state = model.new_state(1)
    n = G + 2
    with pytest.raises(ValueError, match="at most 5 positions"):
        model.ingest(state, torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n, 2, 96, dtype=torch.float64),
                     torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))


def test_training_learns_resumes_and_round_trips(tmp_path, capsys) -> None:
    """train-ring-drafter on the tiny preset: --stop-after ends a run that the same command resumes, the loss falls,
    the checkpoint holds the trained weights (bf16) with the options given, a rerun with more steps resumes, and one
    with another config is refused."""
    import json

    import numpy as np

    from trtllm_dustin.cli import main
    from trtllm_dustin.models.ring_drafter import load_ring_drafter

    np.save(tmp_path / "t.npy", np.random.default_rng(1).integers(2, 257, size=(4, 48)).astype(np.uint16))
    args = ["train-ring-drafter", "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "ring"), "--target",
            "preset:tiny-llama", "--read-layers", "0,1", "--own-layers", "0,2", "--window", "8", "--block", "3",
            "--seq-len", "48", "--batch-size", "2", "--anchor-stride", "5", "--causal-stride", "1", "--lr", "3e-3",
            "--device", "cpu"]
    assert main([*args, "--steps", "40", "--stop-after", "0.001"]) == 0  # one step, then resumable
    assert json.loads((tmp_path / "ring" / "training_record.json").read_text())["steps_done"] == 1
    assert main([*args, "--steps", "40"]) == 0
    assert "resuming at step 1" in capsys.readouterr().out
    record = json.loads((tmp_path / "ring" / "training_record.json").read_text())
    assert record["steps_done"] == 40 and record["final_loss"] < 0.8 * record["first_loss"]
    assert (record["config"]["own_layers"], record["config"]["window"], record["config"]["block"]) == ([0, 2], 8, 3)
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=0).model
    loaded = load_ring_drafter(tmp_path / "ring" / "checkpoint", target)
    trained = torch.load(tmp_path / "ring" / "resume.pt", weights_only=False)["model"]
    assert loaded.fuse.weight.abs().max() > 0 and loaded.own.weight.abs().max() > 0  # F and P trained off zero
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[name].to(value.dtype), rtol=1e-2, atol=1e-2)
    assert main([*args, "--steps", "44"]) == 0
    assert "resuming at step 40" in capsys.readouterr().out
    assert json.loads((tmp_path / "ring" / "training_record.json").read_text())["steps_done"] == 44
    assert main([*args[:-4], "--lr", "1e-3", "--device", "cpu", "--steps", "50"]) != 0
    assert "written with another training config" in capsys.readouterr().err


def test_the_command_refuses_bad_layers_before_loading_anything(tmp_path, capsys) -> None:
    import numpy as np

    from trtllm_dustin.cli import main

    np.save(tmp_path / "t.npy", np.zeros((2, 48), dtype=np.uint16))
    base = ["train-ring-drafter", "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "r"), "--device",
            "cpu", "--target", "preset:tiny-llama"]
    for extra, message in ((["--own-layers", "a,b"], "--own-layers 'a,b': give layer numbers"),
                           (["--read-layers", ""], "at least one of read_layers"),
                           (["--window", "0"], "--window 0")):
        assert main([*base, *extra]) != 0
        assert message in capsys.readouterr().err
    assert main([*base[:2], str(tmp_path / "missing.npy"), *base[3:]]) != 0
    assert "does not exist; write it with `trtllm-dustin prepare-distill-data" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
