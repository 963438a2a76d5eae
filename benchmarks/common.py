"""What every benchmark result file carries: the command, the GPU, the git SHA, the date, the ceilings."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from trtllm_dustin.build_engines.tune import graph_ms  # the engine build's tactic tuner times the same way
from trtllm_dustin.provenance import git_sha

__all__ = ["MEASURED_COPY_BANDWIDTH", "RESULTS", "Clock", "copy_bandwidth", "environment", "git_sha", "graph_ms",
           "save_json", "time_cuda"]

# bytes/s, device-to-device copy measured on the project's GPUs (shared/GPU.md), by a part of the device name
MEASURED_COPY_BANDWIDTH = {"H200": 4.26e12}
RESULTS = Path(__file__).resolve().parent / "results"


def copy_bandwidth() -> float | None:
    """The measured copy ceiling (bytes/s) of the GPU this process runs on, for bandwidth floors; None where none was
    measured (another GPU, such as an H100, or the CPU): a floor is then left out, not quoted from another card."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bandwidth for part, bandwidth in MEASURED_COPY_BANDWIDTH.items() if part in name), None)


def environment() -> dict:
    return {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)",
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
    }


def save_json(path: Path, payload: dict, quiet: bool = False) -> None:
    """Write payload as JSON through a temporary file beside path, so that a reader (or a run killed at its deadline)
    never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


def time_cuda(fn, iters: int = 50, warmup: int = 5) -> list[float]:
    """Milliseconds of each of `iters` calls of fn, timed with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


class Clock:
    """Milliseconds of a callable: CUDA events on the GPU, wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
