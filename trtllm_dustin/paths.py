"""The files and directories a command reads and writes, checked before any work: every input exists and is of the
right kind, every output can be written where it is named. Standard library only, so that `generate` runs these
checks before torch is imported, as validation.py's option checks.

    check_paths(command, args)   the inputs, outputs and model paths of `command` (its table entries below)

An output is probed by creating (and removing) a scratch directory in the deepest directory of its path that
exists, so a path under a read-only or virtual file system (/proc), or under a regular file, is refused before any
work, and nothing is left behind on disk.
"""

from __future__ import annotations

import tempfile
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from trtllm_dustin.validation import InputError

__all__ = ["INPUTS", "MODELS", "OUTPUTS", "Input", "Output", "check_input", "check_model_path", "check_output",
           "check_paths"]


@dataclass(frozen=True)
class Output:
    """What a command writes at an option's path: a directory, or a file (`suffix`: the one it must end with)."""

    directory: bool
    suffix: str = ""
    must_not_exist: bool = False  # a directory the command creates, refused when it exists (unless --force)
    example: str = "out"  # a file's name, for the message that asks for one


@dataclass(frozen=True)
class Input:
    """What a command reads at an option's path, and how a user makes one (for the message)."""

    directory: bool
    what: str  # "a text file", "the Dustin config JSON `trtllm-dustin search` writes", ...
    token_file: bool = False  # a .npy of token windows (prepare-distill-data's): its header is read too
    make: str = ""  # how to write a missing one ({path}: the path given), when a command does


_DIR, _JSON, _NPY = Output(directory=True), Output(directory=False, example="out.json"), \
    Output(directory=False, suffix=".npy", example="tokens.npy")
_TOKENS = Input(directory=False, what="the .npy file of token windows `trtllm-dustin prepare-distill-data --out "
                "FILE.npy` writes", token_file=True, make="write it with `trtllm-dustin prepare-distill-data --out "
                "{path}`")
_DUSTIN = Input(directory=False, what="the Dustin config JSON `trtllm-dustin search` writes")
_SRH = Input(directory=False, what="the SRH JSON `trtllm-dustin srh` writes")
_ENGINE = Input(directory=True, what="an engine directory `trtllm-dustin build --out DIR` writes")

# command -> {argparse dest: what it writes}
OUTPUTS: dict[str, dict[str, Output]] = {
    "build": {"out": Output(directory=True, must_not_exist=True)},
    "triton-repo": {"out": _DIR},
    "serve": {"log": Output(directory=False, example="serve.log")},
    "prepare-distill-data": {"out": _NPY},
    "regenerate-data": {"out": _NPY},
    "train-draft": {"out": _DIR}, "train-longspark": {"out": _DIR}, "train-ring-drafter": {"out": _DIR},
    "srh": {"out": _JSON},
    "arr": {"out_dir": _DIR},
    "fetch-model": {"dir": _DIR},
    "search": {"out": _JSON, "record": _JSON, "work_dir": _DIR, "plots": _DIR},
    "search-layers": {"out": _JSON, "record": _JSON, "save_windows": Output(directory=False, suffix=".npz",
                                                                                   example="windows.npz")},
}
# command -> {argparse dest: what it reads}
INPUTS: dict[str, dict[str, Input]] = {
    "generate": {"prompt_file": Input(directory=False, what="a text file"), "dustin_config": _DUSTIN,
                 "engine": _ENGINE},
    "build": {"dustin_config": _DUSTIN},
    "triton-repo": {"dustin_config": _DUSTIN, "engine": _ENGINE},
    "serve": {"repo": Input(directory=True, what="the repository directory `trtllm-dustin triton-repo --out DIR` "
                            "writes")},
    "regenerate-data": {"tokens": _TOKENS}, "train-draft": {"tokens": _TOKENS},
    "train-longspark": {"tokens": _TOKENS}, "train-ring-drafter": {"tokens": _TOKENS},
    "arr": {"target_srh": _SRH, "draft_srh": _SRH},
    "search": {"target_srh": _SRH, "draft_srh": _SRH},
    "search-layers": {"config": _DUSTIN, "srh": _SRH,
                      "windows": Input(directory=False, what="the .npz file `search-layers --save-windows` writes")},
}


# command -> argparse dests that name a model: the default, a packaged one, preset:NAME, a directory or a .gguf file
MODELS: dict[str, tuple[str, ...]] = {
    "generate": ("model", "draft"), "build": ("model", "draft"), "triton-repo": ("model", "draft"),
    "regenerate-data": ("target",), "train-draft": ("target",), "train-longspark": ("target",),
    "train-ring-drafter": ("target",), "srh": ("model", "tokenizer_from"), "arr": ("target", "draft"),
    "search": ("target", "draft"), "search-layers": ("target",),
}


def check_paths(command: str, args: Namespace) -> None:
    """Every input and output path of `command` that was given (None: not used, or a default decided later), and
    every model named by a path."""
    values = vars(args)
    for dest in MODELS.get(command, ()):
        if values.get(dest) is not None:
            check_model_path(_option(dest), values[dest])
    for dest, kind in INPUTS.get(command, {}).items():
        if values.get(dest) is not None:
            check_input(_option(dest), Path(values[dest]), kind)
    for dest, kind in OUTPUTS.get(command, {}).items():
        if values.get(dest) is not None:
            check_output(_option(dest), Path(values[dest]), kind, force=bool(values.get("force")))


def _option(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def check_model_path(option: str, spec: str) -> None:
    """A model named by a path exists as a checkpoint directory or a .gguf file (names and presets: open_model)."""
    from trtllm_dustin.fetch import FETCHABLE, fetched_path
    from trtllm_dustin.models.errors import ModelLoadError
    from trtllm_dustin.models.packaged import DEFAULT_DRAFT, DEFAULT_MODEL

    if spec in (DEFAULT_MODEL, DEFAULT_DRAFT) or spec.startswith("preset:"):
        return
    if spec in FETCHABLE:
        try:
            fetched_path(spec)
        except ModelLoadError as e:
            raise InputError(f"{option} {e}") from e
        return
    path = Path(spec).expanduser()
    forms = "pass a checkpoint directory, a .gguf file or preset:NAME"
    if not path.exists():
        raise InputError(f"{option} {spec} does not exist; {forms}")
    if path.is_file() and path.suffix != ".gguf":
        raise InputError(f"{option} {spec} is a file but not a .gguf one; {forms}")


def check_input(option: str, path: Path, kind: Input) -> None:
    """`path` exists and is a directory or a file as `kind` says (a token file: a readable 2-D integer .npy)."""
    shown = f"{option} {path}"
    if not path.exists():
        fix = kind.make.format(path=path) if kind.make else f"pass {kind.what}"
        raise InputError(f"{shown} does not exist; {fix}")
    if kind.directory and not path.is_dir():
        raise InputError(f"{shown} is a file, not a directory; pass {kind.what}")
    if not kind.directory and path.is_dir():
        raise InputError(f"{shown} is a directory; pass {kind.what}")
    if kind.token_file:
        _check_token_file(shown, path, kind)


def _check_token_file(shown: str, path: Path, kind: Input) -> None:
    """The .npy header only (numpy, not torch): a 2-D array of integer token ids, no pickled objects."""
    import numpy as np

    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        why = "it holds pickled objects" if "allow_pickle" in str(e) else str(e).split("\n")[0].rstrip(".")
        raise InputError(f"{shown} is not a .npy array of token ids ({why}); pass {kind.what}") from None
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.dtype.kind not in "iu" or data.size == 0:
        shape = getattr(data, "shape", "?")
        dtype = getattr(data, "dtype", type(data).__name__)
        raise InputError(f"{shown} holds a {dtype} array of shape {tuple(shape)}, not [windows, seq_len] integer token "
                         f"ids; pass {kind.what}")


def check_output(option: str, path: Path, kind: Output, force: bool = False) -> None:
    """`path` can be written as `kind` says, tried in the deepest directory of it that exists (nothing is left)."""
    shown = f"{option} {path}"
    if kind.directory:
        if path.exists() and not path.is_dir():
            raise InputError(f"{shown} is a file, not a directory; pass a directory path (it is created)")
        if kind.must_not_exist and path.exists() and not force:
            raise InputError(f"{shown} exists; choose another directory or pass --force to replace it")
    else:
        if path.is_dir():
            example = path / kind.example
            raise InputError(f"{shown} is a directory, not a file; pass a file path, e.g. {example}")
        if kind.suffix and path.suffix != kind.suffix:
            raise InputError(f"{shown} does not end in {kind.suffix}; name the file {path.name}{kind.suffix} (it is "
                             f"written as a {kind.suffix} file)")
    parent = path if kind.directory and path.is_dir() else path.parent
    existing = parent
    while not existing.exists():  # the deepest directory of the path that exists: where the first mkdir happens
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{shown}: {existing} is a file, not a directory; pass a path under a directory")
    try:
        tempfile.TemporaryDirectory(prefix=".trtllm-dustin-probe-", dir=existing).cleanup()
    except OSError as e:
        raise InputError(f"{shown} cannot be written: {existing} does not take new files ({e.strerror}); pass a "
                         "path in a directory you can write to") from None
    if not kind.directory and path.is_file() and not _writable(path):
        raise InputError(f"{shown} exists and cannot be overwritten (permission denied); pass another path")


def _writable(path: Path) -> bool:
    try:
        with open(path, "ab"):
            return True
    except OSError:
        return False
