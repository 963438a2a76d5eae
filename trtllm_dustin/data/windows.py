"""Token windows: documents tokenised with a given tokenizer and cut into sequences of one fixed length.

A window never crosses a document boundary, so every window is one stretch of one document (the long-context
setting: a prompt is one long document, not a pack of short ones). A document shorter than the window gives none.

`token_windows` refuses test documents unless `allow_test=True`, which only the final report passes; it recomputes
each document's split from its id rather than trusting the caller's filter.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trtllm_dustin.data.corpora import split_documents
from trtllm_dustin.data.document import Document
from trtllm_dustin.data.splits import TestSplitError, document_split, require_not_test

__all__ = ["Encode", "TokenWindow", "as_encoder", "token_windows", "training_windows"]

Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class TokenWindow:
    """`length` consecutive tokens of one document."""

    doc_id: str
    start: int  # index of tokens[0] in the document's token sequence
    tokens: tuple[int, ...]


def as_encoder(tokenizer: Encode | Any) -> Encode:
    """An `encode(text) -> token ids` callable from a callable or a Hugging Face tokenizer.

    A Hugging Face tokenizer encodes with add_special_tokens=False, so a window holds text tokens only (no BOS in the
    middle of a document); add special tokens when building the prompt.
    """
    if callable(getattr(tokenizer, "encode", None)) and hasattr(tokenizer, "convert_ids_to_tokens"):

        def encode(text: str) -> Sequence[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return encode
    if callable(tokenizer):
        return tokenizer
    raise TypeError(
        f"expected a callable str -> list[int] or a Hugging Face tokenizer, got {type(tokenizer).__name__}; "
        "wrap other tokenizers, e.g. lambda text: tok.encode(text).ids"
    )


def token_windows(
    documents: Iterable[Document],
    tokenizer: Encode | Any,
    length: int,
    *,
    stride: int | None = None,
    max_per_document: int | None = None,
    allow_test: bool = False,
) -> Iterator[TokenWindow]:
    """Windows of exactly `length` tokens from each document, starting at token 0 and every `stride` tokens after.

    stride defaults to `length` (back-to-back windows); the tail shorter than `length` is dropped.
    max_per_document=1 gives one prefix window per document. A test-split document raises TestSplitError unless
    allow_test=True (the final report only).
    """
    if length < 1:
        raise ValueError(f"length={length} must be at least 1 token")
    stride = length if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride={stride} must be at least 1 token")
    if max_per_document is not None and max_per_document < 1:
        raise ValueError(f"max_per_document={max_per_document} must be at least 1, or None for no limit")
    encode = as_encoder(tokenizer)
    for document in documents:
        if not allow_test and document_split(document) == "test":
            raise TestSplitError(
                f"{document.doc_id} is in the test split, which may not be used for training, searching or tuning; "
                "read documents through split_documents('train' or 'validation')"
            )
        ids = encode(document.text)
        if len(ids):
            operator.index(ids[0])  # fail early on an encoder that returns strings or floats
        starts = range(0, len(ids) - length + 1, stride)
        if max_per_document is not None:
            starts = starts[:max_per_document]
        for start in starts:
            yield TokenWindow(document.doc_id, start, tuple(ids[start : start + length]))


def training_windows(
    tokenizer: Encode | Any,
    length: int,
    *,
    split: str = "train",
    sources: Iterable[str] | None = None,
    stride: int | None = None,
    max_per_document: int | None = None,
) -> Iterator[TokenWindow]:
    """Windows of the train split (fitting) or the validation split (searching, tuning); split="test" is refused."""
    require_not_test(split)
    return token_windows(
        split_documents(split, sources), tokenizer, length, stride=stride, max_per_document=max_per_document
    )
