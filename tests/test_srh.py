"""SRH identification: ROUGE-1 recall, needle prompts, scoring on a planted head, the end-to-end path on a preset."""

from __future__ import annotations

import pytest
import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import load_model
from trtllm_dustin.search.needle_haystack import NEEDLES, build_prompt
from trtllm_dustin.search.rouge import rouge1_recall, words
from trtllm_dustin.search.srh import SRHResult, SRHSettings, head_scores, identify_srh, needle_mass, top_heads


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256 + 1 for the tiny presets), with a two-tag chat template."""

    chat_template = "<u>{content}</u><a>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return self.chat_template.format(content=messages[0]["content"])


def test_rouge1_recall_on_hand_examples() -> None:
    needle = "The password for the old library vault is silver falcon ninety two."
    assert words("Rosa's soup!") == ["rosa", "s", "soup"]
    assert rouge1_recall(needle, needle) == 1.0
    assert rouge1_recall("silver falcon", needle) == pytest.approx(2 / 12)
    # "the" occurs twice in the reference: one "the" in the answer matches once (clipped counts).
    assert rouge1_recall("THE vault, the vault, the vault", needle) == pytest.approx(3 / 12)
    assert rouge1_recall("", needle) == 0.0 and rouge1_recall("anything", "") == 0.0


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_prompt_has_exact_length_and_span(depth: float) -> None:
    tok = ByteTokenizer()
    haystack = tok.encode("Stones are grey. Rivers run. " * 40)
    prompt = build_prompt(tok, haystack, NEEDLES[1], 600, depth)
    assert len(prompt.tokens) == 600
    assert tok.decode(list(prompt.needle_tokens)) == " " + NEEDLES[1].text
    text = tok.decode(list(prompt.tokens))
    assert text.startswith("<u>Read the text") and text.endswith("complete sentence.</u><a>")
    before = tok.decode(list(prompt.tokens[: prompt.needle_span[0]]))
    if 0.0 < depth < 1.0:
        assert before.rstrip().endswith(".")  # snapped to a sentence start
    with pytest.raises(ValueError, match="no room"):
        build_prompt(tok, haystack, NEEDLES[1], 100, depth)


def test_planted_retrieval_head_ranks_first() -> None:
    """Synthetic attention: head 2 of layer 1 puts most of its mass on the needle span, every other head is random."""
    gen = torch.Generator().manual_seed(0)
    B, layers, heads, S = 5, 3, 4, 64
    spans = [(10, 18), (30, 38), (0, 8), (50, 58), (20, 28)]
    span_mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (lo, hi) in enumerate(spans):
        span_mask[b, lo:hi] = True
    per_test = torch.zeros(B, layers, heads, dtype=torch.float64)
    for _step in range(6):  # needle steps
        for layer in range(layers):
            probs = torch.softmax(torch.randn(B, heads, S, generator=gen), -1)
            if layer == 1:
                planted = span_mask.float() / span_mask.sum(-1, keepdim=True) * 0.8
                probs[:, 2] = planted + 0.2 * probs[:, 2]
            per_test[:, layer] += needle_mass(probs, span_mask).double()
    recalls = torch.tensor([0.9, 0.8, 1.0, 0.6, 0.7])
    scores = head_scores(per_test, recalls, 0.5)
    assert scores[1, 2] == scores.max()
    assert top_heads(scores, 2)[1].heads[0] == 2
    assert len(top_heads(scores, 2)[0].heads) == 2


def test_only_tests_above_the_recall_threshold_count() -> None:
    per_test = torch.tensor([[[1.0, 0.0]], [[0.0, 5.0]]], dtype=torch.float64)  # [tests, layers, heads]
    scores = head_scores(per_test, torch.tensor([0.9, 0.5]), 0.5)  # the second test (recall 0.5) does not count
    assert scores.tolist() == [[1.0, 0.0]]
    assert torch.isnan(head_scores(per_test, torch.tensor([0.1, 0.2]), 0.5)).all()


def test_identify_srh_end_to_end_on_a_tiny_preset(tmp_path) -> None:
    model = load_model("preset:tiny-llama", seed=0).model
    tok = ByteTokenizer()
    haystack = tok.encode("Grey stones lie still. Rivers run to the sea. " * 30)
    # A random model retrieves nothing, so min_recall=-1 counts every test (the random-draft path does the same).
    settings = SRHSettings(context_lengths=(300, 340), depths=(0.0, 0.5, 1.0), needles=3, max_new_tokens=3,
                           min_recall=-1.0, heads_per_layer=2, batch=3, chunk=512)
    result = identify_srh(model, tok, settings, haystack=haystack, progress=False, note="random weights")
    assert len(result.tests) == 3 * 2 * 3 and result.counted == 18
    assert [lh.layer for lh in result.layers] == [0, 1, 2] and all(len(lh.heads) == 2 for lh in result.layers)
    assert result.scores().shape == (3, 6)
    result.save(tmp_path / "srh.json")
    again = SRHResult.load(tmp_path / "srh.json")
    assert again == result and again.layers == result.layers
    strict = again.with_min_recall(0.5)
    assert strict.counted == 0 and strict.layers == ()
    with pytest.raises(ConfigError, match="no heads"):
        strict.heads_of(0)


def test_srh_settings_refuse_bad_values() -> None:
    with pytest.raises(ConfigError, match="depths"):
        SRHSettings(depths=(0.5, 1.5))
    with pytest.raises(ConfigError, match="needles"):
        SRHSettings(needles=len(NEEDLES) + 1)
