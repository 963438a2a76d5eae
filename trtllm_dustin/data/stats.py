"""Corpus statistics: documents per source and split, and how many are long enough for a 32K-token context.

Without a tokenizer, length is measured three ways: characters, whitespace-separated words, and an estimate of
subword tokens as characters / 4 (about right for English prose with a ~32K-50K vocabulary; code and Early Modern
spelling give more tokens per character, so it undercounts them). Pass `encode` for real token counts.

    python -m trtllm_dustin.data.stats            # all sources, markdown table
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field

from trtllm_dustin.data.corpora import SOURCES, iter_documents
from trtllm_dustin.data.splits import SPLITS, document_split
from trtllm_dustin.data.windows import Encode, as_encoder

__all__ = ["LONG_THRESHOLD", "SourceStats", "corpus_stats", "format_table", "main"]

LONG_THRESHOLD = 32_768  # the context length the long-document counts are for
_CHARS_PER_TOKEN = 4  # the estimate of characters per subword token used when no tokenizer is given


@dataclass(frozen=True)
class SourceStats:
    """Counts for one source; the `long_*` counts are of documents with at least LONG_THRESHOLD units."""

    source: str
    documents: int
    works: int
    per_split: dict[str, int] = field(hash=False)  # split -> documents
    characters: int
    long_by_characters: int
    long_by_words: int
    long_by_tokens: int  # tokens from `encode`, else characters / 4
    tokens_measured: bool  # whether long_by_tokens used a real tokenizer


def corpus_stats(sources: Iterable[str] | None = None, encode: Encode | None = None) -> list[SourceStats]:
    """Statistics of each source (default: all), in registry order."""
    encoder = as_encoder(encode) if encode is not None else None
    stats = []
    for source in list(SOURCES) if sources is None else list(sources):
        per_split = dict.fromkeys(SPLITS, 0)
        works, documents, characters, long_chars, long_words, long_tokens = set(), 0, 0, 0, 0, 0
        for document in iter_documents([source]):
            documents += 1
            works.add(document.split_key)
            per_split[document_split(document)] += 1
            characters += len(document.text)
            long_chars += len(document.text) >= LONG_THRESHOLD
            long_words += len(document.text.split()) >= LONG_THRESHOLD
            tokens = len(encoder(document.text)) if encoder else len(document.text) // _CHARS_PER_TOKEN
            long_tokens += tokens >= LONG_THRESHOLD
        stats.append(
            SourceStats(
                source, documents, len(works), per_split, characters, long_chars, long_words, long_tokens, bool(encoder)
            )
        )
    return stats


def format_table(stats: list[SourceStats]) -> str:
    """A markdown table of the statistics, with a total row."""
    token_header = "≥32K tokens" if stats and stats[0].tokens_measured else "≥32K est. tokens (chars/4)"
    header = ["source", "docs", "works", *SPLITS, "MB", "≥32K chars", "≥32K words", token_header]
    rows = [header, ["---"] * len(header)]
    for s in stats:
        rows.append(
            [
                s.source,
                s.documents,
                s.works,
                *(s.per_split[split] for split in SPLITS),
                f"{s.characters / 1e6:.1f}",
                s.long_by_characters,
                s.long_by_words,
                s.long_by_tokens,
            ]
        )
    rows.append(
        [
            "total",
            sum(s.documents for s in stats),
            sum(s.works for s in stats),
            *(sum(s.per_split[split] for s in stats) for split in SPLITS),
            f"{sum(s.characters for s in stats) / 1e6:.1f}",
            sum(s.long_by_characters for s in stats),
            sum(s.long_by_words for s in stats),
            sum(s.long_by_tokens for s in stats),
        ]
    )
    return "\n".join("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", nargs="*", choices=list(SOURCES), help="default: all sources")
    args = parser.parse_args(argv)
    print(format_table(corpus_stats(args.sources)))


if __name__ == "__main__":
    main()
