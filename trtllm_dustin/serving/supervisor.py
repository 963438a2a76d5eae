"""Keeping tritonserver up: `serve` restarts it when it dies, logs why and counts it in /metrics.

A backend that dies (a crash no guard foresaw, an out-of-memory kill, a `kill -9` by hand) is noticed within
`poll_s`: tritonserver itself, or one of its Python-backend stubs (the processes that run the engines: Triton does
not start a dead stub again, it answers "Stub process ... is not healthy" until restarted). Whatever of its process
group is left (backend stubs) is killed, its metrics snapshots are removed (their counters restart from zero with
it), and it is started again on the same ports, so clients retry where they were. Starting takes as long as the
models take to load (the default pair, two methods, on 2 shared CPU cores: 10 to 20 s). Three starts in a row that
fail end `serve` with an error: a backend that cannot start is not retried forever.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from trtllm_dustin.serving.launch import ServerError, TritonServer, processes_in_group
from trtllm_dustin.serving.metrics import FrontMetrics

__all__ = ["Supervisor"]

MAX_FAILED_STARTS = 3


class Supervisor:
    def __init__(self, server: TritonServer, metrics: FrontMetrics, metrics_dir: str | Path,
                 poll_s: float = 0.5) -> None:
        self.server, self.metrics, self.metrics_dir, self.poll_s = server, metrics, Path(metrics_dir), poll_s
        self.restarts = 0
        self.stubs = self._members()  # the backend stubs of the running server

    def _members(self) -> set[int]:
        pid = self.server.process.pid
        return set(processes_in_group(pid)) - {pid}

    def watch(self, stop: threading.Event) -> bool:
        """Until `stop` is set: restart the server whenever it dies. False when it could not be started again."""
        self.metrics.backend_up.set(1)
        while not stop.wait(self.poll_s):
            if self.server.process.poll() is None:
                dead = self.stubs - self._members()
                if not dead:
                    continue
                what = f"its backend process {min(dead)} died"
            else:
                what = f"it exited with {self.server.process.returncode}"
            self.restarts += 1
            self.metrics.restarts.inc()
            self.metrics.backend_up.set(0)
            print(f"trtllm-dustin: tritonserver failed: {what} (log: {self.server.log_path}); restarting it "
                  f"(restart {self.restarts})", file=sys.stderr, flush=True)
            if not self._restart(stop):
                return False
        return True

    def _restart(self, stop: threading.Event) -> bool:
        for attempt in range(1, MAX_FAILED_STARTS + 1):
            self._clear()
            t0 = time.monotonic()
            try:
                self.server.start()
            except ServerError as e:
                print(f"trtllm-dustin: error: restart attempt {attempt} of {MAX_FAILED_STARTS} failed: "
                      f"{str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                if stop.wait(2.0):
                    return True
                continue
            self.stubs = self._members()
            self.metrics.backend_up.set(1)
            print(f"tritonserver is back after {time.monotonic() - t0:.1f} s (restart {self.restarts})", flush=True)
            return True
        print(f"trtllm-dustin: error: tritonserver did not start again after {MAX_FAILED_STARTS} attempts; see "
              f"{self.server.log_path}", file=sys.stderr, flush=True)
        return False

    def _clear(self) -> None:
        """Kill what is left of the dead server's process group, forget its engines' snapshots."""
        if self.server.process is not None:
            try:
                os.killpg(self.server.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for snapshot in self.metrics_dir.glob("*.json"):
            snapshot.unlink(missing_ok=True)
