"""The engine's metrics, kept in the backend process and written as a JSON snapshot that the HTTP front exports.

The serving engine runs inside Triton's Python-backend stub, a process the front (front.py) cannot reach into, so the
engine counts here and a writer thread replaces `<TRTLLM_DUSTIN_METRICS_DIR>/<model>.json` twice a second (write to
a temporary file, then rename: a reader never sees half a file). The front turns each snapshot into Prometheus
families (metrics.py) with the model's name as a label. Counters start again from zero when the backend restarts,
as Prometheus counters may.

Snapshot (schema 1): {"schema": 1, "pid": ..., "samples": [{"kind": "counter" | "gauge" | "histogram", "name": ...,
"labels": {...}, "value": ...} or, for a histogram, "bounds", "counts" (per bucket, the last one past every bound),
"sum"]}.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from pathlib import Path

__all__ = ["ACCEPTED_BUCKETS", "DESCRIPTIONS", "LATENCY_BUCKETS", "METRICS_DIR_ENV", "PHASE_BUCKETS",
           "SNAPSHOT_SCHEMA", "EngineMetrics", "Histogram", "SnapshotWriter"]

METRICS_DIR_ENV = "TRTLLM_DUSTIN_METRICS_DIR"  # set by the launcher (launch.py) in the server's environment
SNAPSHOT_SCHEMA = 1
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ACCEPTED_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)  # tokens committed per round: accepted drafts + 1 <= gamma + 1

# name -> help text, for every sample the engine writes (the front's own metrics are described in metrics.py)
DESCRIPTIONS = {
    "dustin_requests": "Requests the engine finished, by method and outcome (ok, cancelled, error, invalid, rejected)",
    "dustin_prompt_tokens": "Prompt tokens of the requests admitted into a batch slot",
    "dustin_generated_tokens": "Tokens generated (committed), stop-string tails included",
    "dustin_time_to_first_token_seconds": "From a request's arrival at the engine (queue wait included) to its "
                                          "first token",
    "dustin_inter_token_latency_seconds": "Time between a request's consecutive tokens (a round's tokens share the "
                                          "round's time)",
    "dustin_accepted_length": "Tokens a request committed per round (accepted draft tokens + 1; 1 for vanilla)",
    "dustin_mean_accepted_length": "Mean of dustin_accepted_length since the backend started (0 before any round)",
    "dustin_phase_seconds": "Time per round of each decode phase (draft, estimate, select, verify, accept)",
    "dustin_queue_depth": "Requests waiting for a batch slot",
    "dustin_running_slots": "Batch slots holding a request (prefilling or decoding)",
    "dustin_slots": "Batch slots of each method",
    "dustin_kv_cache_tokens": "KV cache positions the running requests hold (prompt + generated)",
    "dustin_kv_cache_capacity_tokens": "KV cache positions of each method (slots x max_seq_len)",
    "dustin_prefix_cache_bytes": "Bytes of prompt-prefix K/V held by the prefix cache",
    "dustin_prefix_cache_capacity_bytes": "The prefix cache's limit (--prefix-cache-mib; 0: off)",
    "dustin_prefix_cache_reused_tokens": "Prompt tokens served from the prefix cache instead of prefilled",
}


class Histogram:
    """Fixed buckets, counts per bucket (not cumulative), the sum of the observations."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket: past every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times


class EngineMetrics:
    """Counters, gauges and histograms keyed by (name, labels); thread-safe; `snapshot()` gives the JSON text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = {}
        self._gauges: dict[tuple[str, tuple], float] = {}
        self._histograms: dict[tuple[str, tuple], Histogram] = {}

    def count(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._gauges[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name: str, bounds: tuple[float, ...], value: float, times: int = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = Histogram(bounds)
            histogram.observe(value, times)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's value (0 when never set)."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            return self._counters.get(key, self._gauges.get(key, 0))

    def snapshot(self) -> str:
        with self._lock:
            samples = [{"kind": "counter", "name": n, "labels": dict(ls), "value": v}
                       for (n, ls), v in self._counters.items()]
            samples += [{"kind": "gauge", "name": n, "labels": dict(ls), "value": v}
                        for (n, ls), v in self._gauges.items()]
            samples += [{"kind": "histogram", "name": n, "labels": dict(ls), "bounds": list(h.bounds),
                         "counts": list(h.counts), "sum": h.sum} for (n, ls), h in self._histograms.items()]
        return json.dumps({"schema": SNAPSHOT_SCHEMA, "pid": os.getpid(), "samples": samples})


class SnapshotWriter:
    """A daemon thread that writes `metrics.snapshot()` to `path` every `interval_s` (atomically) until stopped."""

    def __init__(self, metrics: EngineMetrics, path: str | Path, interval_s: float = 0.5) -> None:
        self.metrics, self.path, self.interval_s = metrics, Path(path), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dustin-metrics", daemon=True)
        self._thread.start()

    def write(self) -> None:
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(self.metrics.snapshot())
        os.replace(partial, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError:
                pass  # the front removed the folder (the server is stopping); the next write tries again

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
