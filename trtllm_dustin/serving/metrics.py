"""`/metrics`: the front's own counters and the engines' snapshots, in Prometheus's text format (prometheus_client).

The front counts what it sees (HTTP requests by route and status, backend restarts); each served model's engine
counts the rest in its own process and writes a snapshot (stats.py) that `EngineCollector` reads at every scrape,
adding the label `model`. Families (engine ones per model and method):

    dustin_http_requests_total{route, status}         dustin_backend_restarts_total     dustin_backend_up
    dustin_requests_total{outcome}                    dustin_prompt_tokens_total         dustin_generated_tokens_total
    dustin_time_to_first_token_seconds (histogram)    dustin_inter_token_latency_seconds (histogram)
    dustin_accepted_length (histogram)                dustin_mean_accepted_length
    dustin_phase_seconds{phase} (histogram)           dustin_queue_depth   dustin_running_slots   dustin_slots
    dustin_kv_cache_tokens, _capacity_tokens          dustin_prefix_cache_bytes, _capacity_bytes, _reused_tokens
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from trtllm_dustin.serving.stats import DESCRIPTIONS, SNAPSHOT_SCHEMA

__all__ = ["CONTENT_TYPE", "EngineCollector", "FrontMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """Reads every `<model>.json` snapshot of `folder` at collection time."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def snapshots(self) -> dict[str, dict]:
        out = {}
        for path in sorted(self.folder.glob("*.json")):
            try:
                snapshot = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced or removed while read (a restart): the next scrape has it
            if snapshot.get("schema") == SNAPSHOT_SCHEMA:
                out[path.stem] = snapshot
        return out

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, snapshot in self.snapshots().items():
            for sample in snapshot["samples"]:
                name, labels = sample["name"], {"model": model, **sample["labels"]}
                keys = sorted(labels)
                family = families.get(name)
                if family is None:
                    family = families[name] = _family(sample["kind"], name, keys)
                values = [labels[k] for k in keys]
                if sample["kind"] == "histogram":
                    buckets, total = [], 0
                    for bound, count in zip([*map(str, sample["bounds"]), "+Inf"], sample["counts"], strict=True):
                        total += count
                        buckets.append((bound, total))
                    family.add_metric(values, buckets, sample["sum"])
                    if name == "dustin_accepted_length":
                        mean = families.get("dustin_mean_accepted_length")
                        if mean is None:
                            mean = families["dustin_mean_accepted_length"] = _family(
                                "gauge", "dustin_mean_accepted_length", keys)
                        mean.add_metric(values, sample["sum"] / total if total else 0.0)
                else:
                    family.add_metric(values, sample["value"])
        yield from families.values()


def _family(kind: str, name: str, labels: list[str]) -> Metric:
    text = DESCRIPTIONS.get(name, name)
    if kind == "counter":
        return CounterMetricFamily(name, text, labels=labels)
    if kind == "gauge":
        return GaugeMetricFamily(name, text, labels=labels)
    return HistogramMetricFamily(name, text, labels=labels)


class FrontMetrics:
    """The registry `/metrics` renders: the front's counters and the engines' snapshots of `folder`."""

    def __init__(self, folder: str | Path) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter("dustin_http_requests", "HTTP requests the front answered, by route and status",
                                     ["route", "status"], registry=self.registry)
        self.restarts = Counter("dustin_backend_restarts", "Times serve restarted tritonserver after it died",
                                registry=self.registry)
        self.backend_up = Gauge("dustin_backend_up", "1 while tritonserver runs and answers, 0 while it restarts",
                                registry=self.registry)
        self.engines = EngineCollector(folder)
        self.registry.register(self.engines)

    def render(self) -> bytes:
        return generate_latest(self.registry)
