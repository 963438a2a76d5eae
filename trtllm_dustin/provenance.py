"""Where a result file came from: the exact command, the machine, the git SHA, the date and the wall time."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = ["Provenance", "describe_machine", "git_sha"]


def git_sha() -> str:
    """HEAD of the checkout this package runs from (+dirty when trtllm_dustin/ differs from it); $GIT_SHA where the
    tree was copied without .git."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=here).stdout.strip()
        # The package's own sources differing from HEAD means the SHA alone does not name the code that ran.
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(here)], cwd=here).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty(trtllm_dustin/)" if dirty else "")


def describe_machine(device: torch.device | str = "cpu") -> str:
    """"CPU, 2 cores" or the GPU's name: what a reader needs to compare timings."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({platform.machine()} host, {os.cpu_count()} cores)"
    return f"CPU, {os.cpu_count()} cores ({platform.machine()}, torch {torch.get_num_threads()} threads)"


@dataclass(frozen=True)
class Provenance:
    command: str  # the command line that produced the file
    machine: str  # describe_machine()
    git_sha: str  # HEAD when the command ran
    date: str  # UTC, ISO 8601, when the command started
    torch: str  # torch version
    wall_s: float = 0.0  # seconds the whole command took

    @classmethod
    def capture(cls, device: torch.device | str = "cpu", argv: list[str] | None = None) -> Provenance:
        argv = list(sys.argv if argv is None else argv)
        main = sys.modules.get("__main__")
        if argv and getattr(getattr(main, "__spec__", None), "name", None):  # run as `python -m package.module`
            argv = ["-m", main.__spec__.name, *argv[1:]]
        return cls(command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name, *argv]),
                   machine=describe_machine(device), git_sha=git_sha(),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   torch=torch.__version__)

    def finished(self, wall_s: float) -> Provenance:
        return replace(self, wall_s=round(wall_s, 1))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
