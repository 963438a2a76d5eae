"""Fortune cookies from Debian's `fortunes` package: a haystack of another kind than the essays (quotations, jokes,
definitions), for the quality evaluation's generalisation run only; no search or training reads it.

The set-up fetches the package archive with `apt-get download fortunes` into the corpus directory (packages.py);
it is read straight from the .deb (an ar archive holding data.tar.xz), so nothing is installed system-wide. Where
the package is installed, /usr/share/games/fortunes is read instead. Each cookie file holds cookies separated by
lines of "%"; ascii-art is left out. One document per cookie file, its cookies joined into paragraphs.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import tarfile
from collections.abc import Iterator
from pathlib import Path

from trtllm_dustin.data.document import Document
from trtllm_dustin.data.packages import CorpusNotInstalledError, corpus_dir

__all__ = ["FORTUNES_DEB", "FORTUNES_SHA256", "fortune_cookies", "fortunes_documents"]

FORTUNES_DEB = "fortunes_1%3a1.99.1-7.3_all.deb"  # Debian 13's fortunes 1:1.99.1-7.3
FORTUNES_SHA256 = "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5"
_INSTALLED = Path("/usr/share/games/fortunes")
_LEFT_OUT = {"ascii-art"}
_MEMBER_PREFIX = "./usr/share/games/fortunes/"


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The (name, bytes) members of an ar archive (the container of a .deb)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    offset = 8
    while offset + 60 <= len(data):
        header = data[offset: offset + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        yield name, data[offset + 60: offset + 60 + size]
        offset += 60 + size + (size % 2)  # members are 2-byte aligned


def _cookie_files() -> Iterator[tuple[str, str]]:
    """(cookie file name, text) of every cookie file, from the installed package or the downloaded archive."""
    if _INSTALLED.is_dir():
        for path in sorted(_INSTALLED.iterdir()):
            if path.is_file() and not path.suffix and path.name not in _LEFT_OUT:
                yield path.name, path.read_text(encoding="utf-8", errors="replace")
        return
    archive = corpus_dir() / FORTUNES_DEB
    if not archive.is_file():
        raise CorpusNotInstalledError(f"the fortunes corpus is not on this machine: run `apt-get download fortunes` "
                                      f"in {corpus_dir()} (scripts/install.sh does, where apt-get is available)")
    data = archive.read_bytes()
    if hashlib.sha256(data).hexdigest() != FORTUNES_SHA256:
        raise CorpusNotInstalledError(f"{archive} is not the fortunes archive this loader knows (sha256 differs); "
                                      f"fetch {FORTUNES_DEB} again")
    members = dict(_ar_members(data))
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(members["data.tar.xz"]))) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.removeprefix(_MEMBER_PREFIX)
            if (member.isfile() and member.name.startswith(_MEMBER_PREFIX) and "/" not in name and "." not in name
                    and name not in _LEFT_OUT):
                yield name, tar.extractfile(member).read().decode("utf-8", errors="replace")


def fortune_cookies(text: str) -> list[str]:
    """The cookies of one cookie file, each on one line (whitespace collapsed)."""
    return [" ".join(cookie.split()) for cookie in text.split("\n%\n") if cookie.strip() and cookie.strip() != "%"]


def fortunes_documents() -> Iterator[Document]:
    for name, text in _cookie_files():
        cookies = fortune_cookies(text)
        if cookies:
            yield Document(doc_id=f"fortunes/{name}", source="fortunes", title=f"fortune cookies: {name}",
                           licence="Debian fortunes (see its /usr/share/doc/fortunes/copyright)",
                           text="\n\n".join(cookies))
