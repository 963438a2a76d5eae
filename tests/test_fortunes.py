"""The fortunes corpus reader (trtllm_dustin/data/fortunes.py) on a .deb archive built here, and the needle-new task."""

from __future__ import annotations

import io
import lzma
import sys
import tarfile
from pathlib import Path

import pytest

from trtllm_dustin.data import fortunes
from trtllm_dustin.data.packages import CorpusNotInstalledError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quality_tasks  # noqa: E402


def _deb(files: dict[str, str]) -> bytes:
    """A .deb (ar archive) whose data.tar.xz holds the given files under ./usr/share/games/fortunes/."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./usr/share/games/fortunes/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", lzma.compress(b"")),
               ("data.tar.xz", lzma.compress(tar_bytes.getvalue()))]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


@pytest.fixture
def archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    many = "".join(f"Proverb number {i} says little.\n%\n" for i in range(80))
    files = {"wisdom": "A penny saved\nis a penny earned.\n%\nLook before you leap.\n%\n" + many,
             "science": "Entropy always\n  wins.\n%\n", "ascii-art": "  /\\_/\\\n%\n", "wisdom.dat": "binary"}
    data = _deb(files)
    (tmp_path / fortunes.FORTUNES_DEB).write_bytes(data)
    monkeypatch.setenv("TRTLLM_DUSTIN_CORPUS_DIR", str(tmp_path))
    monkeypatch.setattr(fortunes, "_INSTALLED", tmp_path / "not-installed")
    monkeypatch.setattr(fortunes, "FORTUNES_SHA256", __import__("hashlib").sha256(data).hexdigest())
    return tmp_path


def test_cookies_are_read_from_the_archive(archive: Path) -> None:
    docs = {d.doc_id: d for d in fortunes.fortunes_documents()}
    assert sorted(docs) == ["fortunes/science", "fortunes/wisdom"]  # ascii-art and the .dat index are left out
    assert fortunes.fortune_cookies(docs["fortunes/wisdom"].text.replace("\n\n", "\n%\n"))[:3] == [
        "A penny saved is a penny earned.", "Look before you leap.", "Proverb number 0 says little."]
    assert docs["fortunes/science"].text == "Entropy always wins."


def test_a_different_archive_is_refused(archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fortunes, "FORTUNES_SHA256", "0" * 64)
    with pytest.raises(CorpusNotInstalledError, match="sha256 differs"):
        list(fortunes.fortunes_documents())


def test_a_missing_archive_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_DUSTIN_CORPUS_DIR", str(tmp_path))
    monkeypatch.setattr(fortunes, "_INSTALLED", tmp_path / "not-installed")
    with pytest.raises(CorpusNotInstalledError, match="apt-get download fortunes"):
        list(fortunes.fortunes_documents())


class _Words:
    """A tokenizer stand-in: one token per whitespace-separated word."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


def test_needle_new_hides_its_needles_and_asks_for_them(archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quality_tasks, "_encode", lambda tokenizer, text: tokenizer.encode(text))
    texts = []
    monkeypatch.setattr(quality_tasks, "_chat", lambda tokenizer, user, prefix: texts.append(user + prefix) or [1])
    samples = quality_tasks.needle_new_samples(_Words(), 300, 3, seed=5)
    assert [s.kind for s in samples] == ["single", "multikey", "multivalue"]
    for sample, text in zip(samples, texts, strict=True):
        assert all(value in text for value in sample.references)  # every expected value is in the haystack
        assert "locker combination" in text and "says little." in text
    assert len(samples[2].references) == 3 and text.count("One of the locker combinations") == 3
    assert quality_tasks.score(samples[0], f"is {samples[0].references[0]}.")["string_match"] == 1.0
