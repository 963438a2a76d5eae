"""Code: the `.py` sources of the CPython standard library of the running interpreter.

Read from `sysconfig.get_paths()["stdlib"]` (the base interpreter's, also inside a virtual environment). Test code is
left out (any folder named `test`, `tests` or `idle_test`), and so are installed third-party packages
(`site-packages`, `dist-packages`). The set depends on the Python version (3.11 here has ~730 files); each file's
split does not, since it is a function of its top-level package alone.

All modules of one top-level package (`email/*`, `encodings/*`, ...) share a work, so one split: the ~120
generated codec tables under `encodings/` are near-copies of each other and would otherwise sit in every split.
"""

from __future__ import annotations

import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path

from trtllm_dustin.data.document import Document

__all__ = ["CPYTHON_LICENCE", "EXCLUDED_FOLDERS", "cpython_documents", "stdlib_dir"]

CPYTHON_LICENCE = "PSF-2.0 (Python Software Foundation License Version 2)"
EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def cpython_documents(root: Path | None = None) -> Iterator[Document]:
    """One document per standard-library module file, sorted by doc_id (`cpython_stdlib/<relative path>`)."""
    root = stdlib_dir() if root is None else root
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist; is this interpreter complete?")
    paths = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if not EXCLUDED_FOLDERS.intersection(relative.parts[:-1]) and path.is_file():
            paths.append(relative)
    for relative in sorted(paths, key=lambda p: p.as_posix()):
        with tokenize.open(root / relative) as file:  # honours PEP 263 coding cookies
            text = file.read()
        if not text.strip():  # empty __init__.py files
            continue
        name = relative.as_posix()
        yield Document(
            doc_id=f"cpython_stdlib/{name}",
            source="cpython_stdlib",
            title=f"CPython {sysconfig.get_python_version()} Lib/{name}",
            licence=CPYTHON_LICENCE,
            text=text,
            work=f"cpython_stdlib/{relative.parts[0].removesuffix('.py')}",
        )
