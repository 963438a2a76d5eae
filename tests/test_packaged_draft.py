"""The packaged draft for SmolLM2-135M-Instruct: small, cheap per token, recorded, and a useful draft."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_dustin.models import ModelLoadError, load_model
from trtllm_dustin.models.loading import DEFAULT_DRAFT, default_draft_path


@pytest.fixture(scope="module")
def pair(smollm2):
    return smollm2, load_model(DEFAULT_DRAFT, share_with=smollm2.model).model


def test_own_weights_fit_40_mb_and_the_record_says_how_it_was_made() -> None:
    folder = default_draft_path()
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert size <= 40e6, f"own weights {size / 1e6:.1f} MB exceed 40 MB"
    record = json.loads((folder / "training_record.json").read_text())
    for key in ("command", "tokens_file_sha256", "steps_done", "final_loss", "git_sha", "date", "gpu"):
        assert record[key], key
    assert record["config"]["init_layers"] and record["head_vocab_size"] > 0
    assert (folder / "loss_curve.png").stat().st_size > 0


def test_draft_needs_its_target_and_is_five_times_cheaper_per_token(pair) -> None:
    target, draft = pair
    with pytest.raises(ModelLoadError, match="share_with"):
        load_model(DEFAULT_DRAFT)
    t, d = target.model.config, draft.config
    assert d.vocab_size == t.vocab_size and d.hidden_size == t.hidden_size
    assert t.weight_bytes_per_token() >= 5 * d.weight_bytes_per_token()
    assert t.kv_bytes_per_token() >= 5 * d.kv_bytes_per_token()
    torch.testing.assert_close(draft.embed.weight, target.model.embed.weight)  # shared, not stored


def test_draft_predicts_the_targets_next_token_often_on_validation_text(pair) -> None:
    from trtllm_dustin.data import as_encoder, split_documents

    target, draft = pair
    encode = as_encoder(target.tokenizer)
    doc = next(d for d in split_documents("validation", ["shakespeare"]) if len(d.text) > 4000)
    tokens = torch.tensor([encode(doc.text)[:384]])
    with torch.no_grad():
        agree = (target.model.forward_train(tokens).argmax(-1) ==
                 draft.full_vocab(draft.forward_train(tokens)).argmax(-1)).float().mean()
    assert agree > 0.4, f"top-1 agreement {agree:.3f}"  # 0.58 on the test split's books (tau_h200.json)


def test_the_packaged_dustin_config_belongs_to_the_packaged_pair(pair) -> None:
    from trtllm_dustin.dustin_config import DustinConfig
    from trtllm_dustin.models.loading import default_dustin_config_path

    target, draft = pair
    config = DustinConfig.load(default_dustin_config_path())
    config.check_models(target.model.config, draft.config)  # raises on a fingerprint mismatch
    assert all(0 <= lh.layer < target.model.config.num_layers for lh in config.target_layers)
    assert all(0 <= lh.layer < draft.config.num_layers for lh in config.draft_layers)
    assert 0 <= config.m <= config.budget - config.n_sink - config.n_recent


def test_the_packaged_longspark_is_small_recorded_and_loads_for_its_target(pair) -> None:
    """The LongSpark drafter for the default model: its own weights under 8 MB, its record (trained within 20
    minutes), and it loads for the default target and refuses another. Its tau on the real pair was measured on the
    H200 (benchmarks/results/longspark); its decoding equals vanilla in test_speculative / test_longspark."""
    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.models.longspark import default_longspark_path, load_longspark

    folder = default_longspark_path()
    assert (folder / "model.safetensors").stat().st_size <= 8e6
    record = json.loads((folder / "training_record.json").read_text())
    for key in ("command", "tokens_file_sha256", "steps_done", "final_loss", "git_sha", "date", "gpu"):
        assert record[key], key
    assert record["seconds"] <= 20 * 60 and (folder / "loss_curve.png").stat().st_size > 0
    spark = load_longspark(None, pair[0].model)
    assert spark.config.target_layers == (3, 9, 15, 22, 29) and spark.target is pair[0].model
    with pytest.raises(ConfigError, match="trained for another target"):
        load_longspark(None, load_model("preset:smollm2-135m", seed=0).model)
