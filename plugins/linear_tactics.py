"""The skinny-M GEMM's tactic table: which launch configuration each decode-sized projection shape takes.

A table is data written by a sweep (`benchmarks/dev/bench_linear.py`; later one per engine) and read once into a
`KernelConfig`. The packaged one, `tactics/skinny_linear_h200.json`, holds the H200 sweeps of the bench_e2e pairs.
Its rule for a shape that is not listed: F.linear (cuBLAS), because the kernel was only kept where a sweep measured
it at least 2 % faster (or tied, for PDL launches).

A table says which weights its entries were measured for (top-level "weights"; absent: "bf16", bf16 / fp16 weights).
An int8 table (weight-only int8, written by `benchmarks/dev/bench_int8_linear.py --table-out`; packaged:
`tactics/skinny_linear_int8_h200.json`, its "gpu" says where it was measured) also has the 128-row bucket (an int8
call takes the kernel for up to 128 rows), and every entry has a configuration and no tie: an int8 weight has no
cuBLAS path. A shape it does not list takes plugins/skinny_linear.py's fallback (`pick_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LINEAR_TACTICS_SCHEMA_VERSION", "PACKAGED_INT8_LINEAR_TACTICS", "PACKAGED_LINEAR_TACTICS", "WEIGHTS",
           "LinearConfig", "LinearTactic", "LinearTactics", "row_block"]

LINEAR_TACTICS_SCHEMA_VERSION = 1
PACKAGED_LINEAR_TACTICS = Path(__file__).resolve().parent / "tactics" / "skinny_linear_h200.json"
PACKAGED_INT8_LINEAR_TACTICS = Path(__file__).resolve().parent / "tactics" / "skinny_linear_int8_h200.json"
WEIGHTS = ("bf16", "int8")  # what a table's entries were measured for: bf16 / fp16 weights, or weight-only int8
# the kernel's BLOCK_M values per table: calls of 1-64 rows; an int8 weight's of 1-128 (2 * skinny_linear.MAX_ROWS)
_ROW_BUCKETS = {"bf16": (16, 32, 64), "int8": (16, 32, 64, 128)}
_ENTRY_FIELDS = {"rows", "n", "k", "config", "tie", "pair", "batch", "role", "measured_rows", "cublas_us",
                 "kernel_us"}
_REQUIRED_FIELDS = {"rows", "n", "k", "config", "tie"}


def row_block(m: int) -> int:
    """The kernel's BLOCK_M for m rows, which is also the table's row bucket: m rounded up to a power of two >= 16."""
    return max(16, 1 << (max(m, 1) - 1).bit_length())


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration of the skinny linear kernel."""

    block_n: int = 64  # output columns per program
    block_k: int = 128  # K elements per loop step
    split_k: int = 1  # programs per output tile, each summing a contiguous slice of K
    swap: bool = True  # W_tile @ x^T (BLOCK_N in the MMA's M slot) instead of x @ W_tile^T
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name}={value} must be a power of two >= 16")
        for name in ("split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LinearConfig.{name}={value} must be an int >= 1")
        if not isinstance(self.swap, bool):
            raise ValueError(f"LinearConfig.swap={self.swap!r} must be true or false")


@dataclass(frozen=True)
class LinearTactic:
    """One table entry: the shape key, what it runs, and what the sweep measured there."""

    rows: int  # row bucket: the call's rows rounded up to a power of two >= 16 (row_block)
    n: int  # output columns (weight rows)
    k: int  # input columns
    config: LinearConfig | None  # the kernel's launch configuration; None: F.linear (cuBLAS was as fast)
    tie: bool = False  # within 1 % of cuBLAS in the plain-launch sweep: taken only on PDL launches
    pair: str = ""  # the bench_e2e pair whose projection this is (e.g. "llama-8b")
    batch: int | None = None  # that sweep's batch size
    role: str = ""  # which projection (e.g. "target.qkv")
    measured_rows: int | None = None  # the rows the sweep timed (the bucket holds 1 .. rows)
    cublas_us: float | None = None  # F.linear's median per call in the sweep
    kernel_us: float | None = None  # the fastest kernel configuration's median per call


@dataclass(frozen=True)
class LinearTactics:
    """A loaded tactic table: `lookup(m, n, k)` gives the entry of a call's shape, or None (not measured: F.linear for
    bf16 weights, skinny_linear.pick_config's fallback for int8 ones)."""

    source: str  # the file it was read from
    gpu: str  # the GPU it was measured on
    entries: tuple[LinearTactic, ...]
    weights: str = "bf16"  # what the entries were measured for: "bf16" (bf16 / fp16 weights) or "int8"
    by_shape: dict[tuple[int, int, int], LinearTactic] = field(init=False, repr=False, compare=False)  # the index

    def __post_init__(self) -> None:
        _check_weights(self.weights, self.source)
        object.__setattr__(self, "by_shape", {(e.rows, e.n, e.k): e for e in self.entries})

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, m: int, n: int, k: int) -> LinearTactic | None:
        return self.by_shape.get((row_block(m), n, k))

    @classmethod
    def load(cls, path: str | Path) -> LinearTactics:
        """Read and validate a table file; every problem names the file and the entry."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"linear tactic table {path} does not exist; pass an existing file (the packaged ones "
                             f"are {PACKAGED_LINEAR_TACTICS}, bf16, and {PACKAGED_INT8_LINEAR_TACTICS}, "
                             "int8)") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"linear tactic table {path} is not valid JSON: {error}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, source: str) -> LinearTactics:
        if not isinstance(data, dict):
            raise ValueError(f"linear tactic table {source}: expected a JSON object at the top level")
        version = data.get("schema_version")
        if version != LINEAR_TACTICS_SCHEMA_VERSION:
            raise ValueError(f"linear tactic table {source} has schema_version {version!r}; this build reads "
                             f"version {LINEAR_TACTICS_SCHEMA_VERSION}: re-run the sweep that wrote it")
        if not isinstance(data.get("gpu"), str) or not isinstance(data.get("entries"), list):
            raise ValueError(f"linear tactic table {source}: needs \"gpu\" (a string) and \"entries\" (a list)")
        weights = _check_weights(data.get("weights", "bf16"), source)  # before the entries: it sets their buckets
        entries, seen = [], {}
        for i, raw in enumerate(data["entries"]):
            entry = _parse_entry(raw, f"linear tactic table {source}, entry {i} ({json.dumps(raw)[:120]})", weights)
            key = (entry.rows, entry.n, entry.k)
            if key in seen:
                raise ValueError(f"linear tactic table {source}, entry {i}: shape {key} repeats entry {seen[key]}")
            seen[key] = i
            entries.append(entry)
        return cls(source=source, gpu=data["gpu"], entries=tuple(entries), weights=weights)


def _check_weights(weights: object, source: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"linear tactic table {source}: weights={weights!r} is not one of "
                         f"{', '.join(repr(w) for w in WEIGHTS)} (what its entries were measured for; absent: 'bf16')")
    return weights


def _parse_entry(raw: object, where: str, weights: str) -> LinearTactic:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an entry is a JSON object")
    unknown, missing = set(raw) - _ENTRY_FIELDS, _REQUIRED_FIELDS - set(raw)
    if unknown or missing:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}; "
                         f"an entry has {sorted(_ENTRY_FIELDS)}")
    buckets = _ROW_BUCKETS[weights]
    if raw["rows"] not in buckets:
        raise ValueError(f"{where}: rows={raw['rows']!r} must be a row bucket, one of {buckets} (a table of {weights} "
                         "weights)")
    for name in ("n", "k"):
        if not isinstance(raw[name], int) or isinstance(raw[name], bool) or raw[name] < 1:
            raise ValueError(f"{where}: {name}={raw[name]!r} must be an int >= 1")
    if not isinstance(raw["tie"], bool):
        raise ValueError(f"{where}: tie={raw['tie']!r} must be true or false")
    config = raw["config"]
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config must be an object of LinearConfig fields or null (F.linear)")
        try:
            config = LinearConfig(**config)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
    elif raw["tie"]:
        raise ValueError(f"{where}: tie=true needs a config (a tie says which kernel configuration tied)")
    if weights == "int8" and (config is None or raw["tie"]):
        raise ValueError(f"{where}: an int8 table's entry needs a config and tie=false (an int8 weight has no cuBLAS "
                         "path to fall back to or tie with): write the sweep's fastest configuration, tie false")
    return LinearTactic(config=config, **{name: value for name, value in raw.items() if name != "config"})
