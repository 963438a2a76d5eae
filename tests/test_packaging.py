"""One import namespace: plugins/, runtime/ and build_engines/ import as trtllm_dustin.* in every install kind."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"plugins": "trtllm_dustin.plugins", "runtime": "trtllm_dustin.runtime",
          "build_engines": "trtllm_dustin.build_engines"}


def test_installed_namespace_points_at_the_top_level_folders() -> None:
    import importlib

    for folder, module in MAPPED.items():
        mod = importlib.import_module(module)
        assert Path(mod.__file__).resolve().parent == ROOT / folder


def test_every_subpackage_is_listed_in_pyproject() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(("trtllm_dustin",) + p.parent.relative_to(ROOT / "trtllm_dustin").parts)
               for p in (ROOT / "trtllm_dustin").rglob("__init__.py")}
    for folder, module in MAPPED.items():  # subpackages of the mapped folders (runtime/drafters, ...)
        on_disk |= {".".join((module,) + p.parent.relative_to(ROOT / folder).parts)
                    for p in (ROOT / folder).rglob("__init__.py")}
    assert on_disk == listed


def test_regular_wheel_install(tmp_path: Path) -> None:
    """Build a wheel, install it into an empty target, import from outside the source tree."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.fail(f"wheel build failed: {build.stderr[-2000:]}")
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in MAPPED.values():
        assert module.replace(".", "/") + "/__init__.py" in names
    assert not any(n.startswith(("plugins/", "runtime/", "build_engines/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import trtllm_dustin.plugins as p, "
            "trtllm_dustin.runtime.decoder as r, trtllm_dustin.build_engines as b; print(p.__file__, r.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert str(target) in out and str(ROOT) not in out
