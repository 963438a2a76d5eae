"""benchmarks/dev/ring_drafter_probe.py: the band pass, the unrolled slots and the greedy-round scoring against
references, on the tiny preset (CPU, float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "dev"))
import ring_drafter_probe as probe  # noqa: E402

from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.training.longspark import target_features  # noqa: E402


@pytest.fixture(scope="module")
def target():
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model.eval()
    model.setup_rope()
    return model


def _drafter(target, window: int, mode: str = "ar", block: int = 4):
    torch.manual_seed(0)
    return probe.RingDrafter(target, (0, 2), window, block, 0, mode, read=(0, 1)).double()


def test_the_band_pass_equals_dense_attention_over_the_last_w_positions(target) -> None:
    model = _drafter(target, window=4)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 11, h, 16, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    reference = model._attend(q, k, v, ((j <= i) & (j > i - 4))[None])
    torch.testing.assert_close(model._band(q, k, v), reference)
    assert not torch.allclose(model._band(q, k, v), model._attend(q, k, v, (j <= i)[None]))  # the band does cut


def test_the_unrolled_slots_repeat_the_causal_pass_when_the_ring_holds_every_position(target) -> None:
    """At the start (F = 0, P = 0) slot g's input is its token's embedding, as the band pass's is at L + g; with a
    ring as long as the sequence both read the same keys, so slot g's output is the band pass's at L + g. Once P is
    nonzero the later slots read the drafter's own output and differ, and slot 0 does not."""
    model = _drafter(target, window=16)
    tokens = torch.randint(2, 250, (2, 14), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 6, 9])
    feats = target_features(target, tokens, model.read)
    x, s = model(tokens, feats["hidden"], anchors)
    slot_pos = anchors[:, None] + torch.arange(4)
    torch.testing.assert_close(s, x[:, slot_pos].reshape(6, 4, -1))
    with torch.no_grad():
        model.own.weight.normal_(std=0.1)
    _, s2 = model(tokens, feats["hidden"], anchors)
    torch.testing.assert_close(s2[:, 0], s[:, 0])
    assert (s2[:, 1:] - s[:, 1:]).abs().amax() > 1e-3


def test_round_tau_counts_the_leading_agreements() -> None:
    agree = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float64)
    tau = probe.round_tau(agree)
    assert tau == {"gamma1": round(1 + 2 / 3, 4), "gamma2": round(1 + 4 / 3, 4), "gamma3": round(1 + 5 / 3, 4)}


def test_greedy_scoring_gives_the_target_itself_one_plus_gamma(target) -> None:
    """The greedy sequences are the target's argmax continuation, and a drafter that proposes the target's own
    logits at L + g (the alignment the AR draft's row uses) agrees everywhere: tau = 1 + Γ, KL 0. A drafter one
    position late agrees far less."""
    prompts = {"a/0": np.arange(5, 25), "b/0": np.arange(40, 60)}
    seqs = probe.greedy_sequences(target, prompts, ["a/0", "b/0"], 12, 10, torch.device("cpu"))
    final, _ = target.run_whole(seqs[:, :-1])
    assert torch.equal(seqs[:, 12:], target.head(final[:, 11:]).argmax(-1))

    def own(tokens, anchors, slot_pos):
        return target.full_vocab(target.forward_train(tokens))[:, slot_pos].reshape(-1, 4, target.config.vocab_size)

    def late(tokens, anchors, slot_pos):
        return own(tokens, anchors, slot_pos + 1)

    result, blocks = probe.score({"own": own, "late": late}, target, seqs, ["a/0", "b/0"], 12, 4)
    assert blocks == 2 * (22 - 4 - 12)
    assert result["own"]["top1"] == [1.0] * 4 and max(result["own"]["kl"]) < 1e-9
    assert result["late"]["kl"][0] > 0.01
    assert result["own"]["tau"] == {"gamma1": 2.0, "gamma2": 3.0, "gamma3": 4.0}
    assert result["own"]["tau_by_family"]["a"]["gamma3"] == 4.0
    assert result["late"]["tau"]["gamma3"] < 3.0
