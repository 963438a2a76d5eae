"""The kernels' launch choices as data: tile sizes, warps, stages and split rules, one table per GPU.

The launchers (verify_attention.py, sparse_verify_attention.py, srh_score.py, prefill_attention.py, split_kv.py,
fused_ops.py, argmax.py, commit.py) read their choices from `launch_table(device)`; the formulas that turn a shape
into a launch stay in code, the numbers they use are here. A table is `tactics/launch_<gpu>.json` (`gpu_slug` of
the device's name), read and checked once per process and GPU; the skinny-M GEMM's table is
`tactics/skinny_linear_<gpu>.json` beside it (linear_tactics.py). Only the H200 has been swept, so a GPU without a
table of its own (and the CPU interpreter) runs the H200 table, as the GEMM runs the packaged one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from trtllm_dustin.errors import ConfigError
from trtllm_dustin.validation import check_fields, read_versioned

__all__ = ["LAUNCH_SCHEMA_VERSION", "LaunchTable", "gpu_slug", "launch_table", "read_launch_table"]

LAUNCH_SCHEMA_VERSION = 1
TACTICS_DIR = Path(__file__).resolve().parent / "tactics"
FALLBACK_GPU = "h200"  # the swept GPU: its table serves every other


@dataclass(frozen=True)
class VerifyLaunch:
    min_keys_per_split: int  # keys below which one more split costs more in partials than it gains
    tile_bytes: int  # one K tile's bytes: block_n = tile_bytes / (D * element size), halved for 128-row tiles
    max_block_n: int
    num_warps: int
    wide_num_warps: int  # for 128-row tiles, and max_block_n-key tiles over a 16-bit cache
    num_stages: int
    fp8_programs_per_sm: int  # an fp8 cache's tile conversion wants two programs per SM


@dataclass(frozen=True)
class SparseVerifyLaunch:
    min_keys_per_split: int
    block_n: int
    num_warps: int
    num_stages: int
    tile_rows: int  # query rows per program above small_tile_rows rows (a wgmma tile)
    small_tile_rows: int


@dataclass(frozen=True)
class SrhLaunch:
    min_keys_per_split: int  # of the denominator pass
    lse_programs_per_sm: int
    wide_row_block_n: int  # keys per tile when a key row is >= 256 bytes (D = 128 in 16 bits)
    block_n: int
    num_warps: int
    num_stages: int
    sum_block_n: int  # keys per program of the raw-score sum
    sum_num_warps: int


@dataclass(frozen=True)
class PrefillLaunch:
    block_m: int  # 16-bit inputs
    block_n: int
    num_warps: int  # for tiles of >= block_m rows
    num_stages: int
    fp32_block_m: int  # fp32 inputs (the tests): 128 x 128 fp32 tiles exceed the shared memory
    fp32_block_n: int
    fp32_num_warps: int  # for smaller tiles
    fp32_num_stages: int
    interpreter_block: int  # the CPU interpreter's tiles, whose cost is per element


@dataclass(frozen=True)
class CombineLaunch:
    num_warps: int


@dataclass(frozen=True)
class FusedLaunch:
    norm_min_warps: int  # a norm row's warps: its padded width / norm_columns_per_warp, within [min, max]
    norm_max_warps: int
    norm_columns_per_warp: int
    rope_tile: int  # elements of the [heads, D] tile one rotary program covers
    rope_num_warps: int
    silu_block: int  # silu_mul columns per program
    silu_num_warps: int


@dataclass(frozen=True)
class ArgmaxLaunch:
    chunk_num_warps: int
    rows_num_warps: int


@dataclass(frozen=True)
class CommitLaunch:
    num_warps: int


@dataclass(frozen=True)
class LaunchTable:
    gpu: str
    source: str
    verify_attention: VerifyLaunch
    sparse_verify_attention: SparseVerifyLaunch
    srh_score: SrhLaunch
    prefill_attention: PrefillLaunch
    combine_splits: CombineLaunch
    fused_ops: FusedLaunch
    argmax: ArgmaxLaunch
    commit: CommitLaunch

    def __post_init__(self) -> None:
        for part in (self.verify_attention, self.sparse_verify_attention, self.srh_score, self.prefill_attention,
                     self.combine_splits, self.fused_ops, self.argmax, self.commit):
            for name, value in vars(part).items():
                if value < 1:
                    raise ValueError(f"{type(part).__name__}.{name}={value} must be >= 1")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3': the name of a GPU's table."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia").strip()).strip("-")


def read_launch_table(path: Path) -> LaunchTable:
    """A launch table file, checked field by field (ConfigError names the file and the field)."""
    source, fix = str(path), "write it as plugins/tactics/launch_h200.json is written"
    data = read_versioned(path.read_text(), (LAUNCH_SCHEMA_VERSION,), source, fix)
    check_fields(data, LaunchTable, source, fix)  # nested parts too: every field there, each an int
    hints = typing.get_type_hints(LaunchTable)
    try:
        return LaunchTable(**{name: hints[name](**value) if dataclasses.is_dataclass(hints[name]) else value
                              for name, value in data.items()})
    except ValueError as e:
        raise ConfigError(f"{source}: {e}; {fix}") from None


@functools.cache
def _table_for(slug: str) -> LaunchTable:
    path = TACTICS_DIR / f"launch_{slug}.json"
    return read_launch_table(path if path.is_file() else TACTICS_DIR / f"launch_{FALLBACK_GPU}.json")


@functools.cache
def _slug_of(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return FALLBACK_GPU
    return gpu_slug(torch.cuda.get_device_name(index))


def launch_table(device: torch.device) -> LaunchTable:
    """The launch choices for kernels on `device` (read once per process and GPU; no device sync)."""
    return _table_for(_slug_of(device.type, device.index))
