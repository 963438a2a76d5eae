"""ROUGE-1 recall: the fraction of a reference's words that an answer contains (counts clipped, case folded)."""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["rouge1_recall", "words"]

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric runs: "Grandma Rosa's soup!" -> ["grandma", "rosa", "s", "soup"]."""
    return _WORD.findall(text.lower())


def rouge1_recall(answer: str, reference: str) -> float:
    """sum_w min(count_answer(w), count_reference(w)) / len(reference words); 0 for an empty reference."""
    reference_counts = Counter(words(reference))
    total = sum(reference_counts.values())
    if total == 0:
        return 0.0
    answer_counts = Counter(words(answer))
    return sum(min(n, answer_counts[w]) for w, n in reference_counts.items()) / total
