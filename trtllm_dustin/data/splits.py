"""The fixed train / validation / test split of every corpus, and the guard that keeps the test split out of training.

The rule (version 1), for a document's split key `k` (its work, else its doc_id; see `Document.split_key`):

    digest = sha256(("trtllm-dustin-split-v1:" + k).encode("utf-8"))
    bucket = int.from_bytes(digest[:8], "big") % 100            # 0 .. 99
    split  = "train" if bucket < 80 else "validation" if bucket < 90 else "test"

It depends on nothing but the key: not on enumeration order, file-system order, the Python hash seed, the machine or
the other documents. Adding a document never moves another one. By hand, in a shell:

    printf '%s' 'trtllm-dustin-split-v1:KEY' | sha256sum | cut -c1-16    # then (0x<that> % 100)

The test split is for the final report only: never for training, for a hyper-parameter or policy search, or for
tuning. `require_not_test` is the one place that refuses it; the training and tuning entry points call it.
"""

from __future__ import annotations

import hashlib
from typing import Literal, get_args

from trtllm_dustin.data.document import Document

__all__ = [
    "SPLIT_RULE_VERSION",
    "SPLITS",
    "Split",
    "TestSplitError",
    "bucket_of",
    "document_split",
    "require_not_test",
    "split_of",
]

Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)
SPLIT_RULE_VERSION = 1

_SALT = f"trtllm-dustin-split-v{SPLIT_RULE_VERSION}:"
_TRAIN_BUCKETS = 80  # buckets [0, 80) -> train: 80 %
_VALIDATION_BUCKETS = 10  # buckets [80, 90) -> validation: 10 %; [90, 100) -> test: 10 %


class TestSplitError(ValueError):
    """Raised when the test split is asked for where only training or tuning data may go."""

    __test__ = False  # not a pytest test class, despite the name


def bucket_of(split_key: str) -> int:
    """The bucket in [0, 100) of a split key under the documented rule."""
    digest = hashlib.sha256((_SALT + split_key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100


def split_of(split_key: str) -> Split:
    """The split of a split key (a work or a doc_id) under the documented rule."""
    if not split_key:
        raise ValueError("split_of got an empty split key; pass Document.split_key")
    bucket = bucket_of(split_key)
    if bucket < _TRAIN_BUCKETS:
        return "train"
    if bucket < _TRAIN_BUCKETS + _VALIDATION_BUCKETS:
        return "validation"
    return "test"


def document_split(document: Document) -> Split:
    """The split a document belongs to, recomputed from its split key (never stored, so it cannot drift)."""
    return split_of(document.split_key)


def require_not_test(split: str) -> Split:
    """Check that `split` may be used for training, searching or tuning, and return it.

    "train" is for fitting, "validation" for searching and tuning; "test" is refused.
    """
    if split == "test":
        raise TestSplitError(
            "split='test' is reserved for the final report and may not be used for training, searching or tuning; "
            "use split='train' to fit and split='validation' to search or tune"
        )
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]
