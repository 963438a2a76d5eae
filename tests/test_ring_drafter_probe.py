"""benchmarks/dev/ring_drafter_probe.py: the greedy-round scoring against references, and the block mode's shapes,
on the tiny preset (CPU, float64). The drafter itself: tests/test_ring_drafter.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "dev"))
import ring_drafter_probe as probe  # noqa: E402

from trtllm_dustin.models import load_model  # noqa: E402


@pytest.fixture(scope="module")
def target():
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model.eval()
    model.setup_rope()
    return model


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


def test_the_block_mode_shares_the_ring_pass_and_adds_its_markov_correction(target, monkeypatch) -> None:
    """Block mode runs the same ring pass as the AR mode (same weights: the same outputs at every position), and its
    slots' logits are the head's plus the per-slot Markov correction of the previous token (zero at the start)."""
    monkeypatch.setattr(probe, "READ", (0, 1))
    torch.manual_seed(0)
    block = probe.build(target, "block", (0, 2), 6, 4, 3).double()
    ar = probe.build(target, "ar", (0, 2), 6, 4, 3).double()
    with torch.no_grad():
        block.fuse.weight.normal_(std=0.05)
    ar.load_state_dict(block.state_dict(), strict=False)
    tokens = torch.randint(2, 250, (2, 16), generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(4)
    hidden = {i: torch.randn(2, 16, 96, dtype=torch.float64, generator=g) for i in (0, 1)}
    feats = {"hidden": hidden, "final": target.run_whole(tokens)[0]}
    anchors = torch.tensor([4, 8])
    logits, teacher, x = probe.slot_logits(block, target, tokens, anchors, feats)
    _, _, x_ar = probe.slot_logits(ar, target, tokens, anchors, feats)
    torch.testing.assert_close(x, x_ar)
    assert logits.shape == teacher.shape == (4, 4, target.config.vocab_size)
    with torch.no_grad():
        block.markov_out.normal_()
    shifted, _, _ = probe.slot_logits(block, target, tokens, anchors, feats)
    previous = tokens[:, anchors[:, None] + torch.arange(4)].reshape(-1, 4)
    # fp32 logits: (head + markov) - head keeps the correction to the logits' rounding, not the correction's
    scale = float(logits.detach().abs().max())
    torch.testing.assert_close(shifted - logits, block.markov(previous), rtol=0, atol=1e-4 * scale)
