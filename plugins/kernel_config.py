"""Which kernel paths a process runs: one frozen config, read from the environment once, passed to the ops.

Entry points build it (`KernelConfig()` for the defaults, `KernelConfig.from_env()` for the TRTLLM_DUSTIN_* A/B
switches, `KernelConfig.from_json(...)` for a saved one) and hand it to the decoder (`Transformer.kernels`), the
attention backend (`get_backend(name, kernels)`) and the round ops; nothing below reads the environment. A CUDA
graph therefore replays exactly what the config said when it was captured.

  TRTLLM_DUSTIN_PDL                  pdl                  "1" / "0"
  TRTLLM_DUSTIN_FUSED_ELEMENTWISE    fused_elementwise    "1" / "0" / unset: True / False / None
  TRTLLM_DUSTIN_SKINNY_LINEAR        skinny_linear        "1" / "0"
  TRTLLM_DUSTIN_SKINNY_PDL           skinny_pdl           "1" / "0"
  TRTLLM_DUSTIN_SKINNY_TIES          skinny_ties          "1" / "0"
  TRTLLM_DUSTIN_ROUND_KERNELS        round_kernels        "1" / "0"
  TRTLLM_DUSTIN_INT8_WIDE            int8_wide            "1" / "0"
  TRTLLM_DUSTIN_LINEAR_TACTICS       linear_tactics       path of a bf16 tactic table file (linear_tactics.py)
  TRTLLM_DUSTIN_INT8_LINEAR_TACTICS  int8_linear_tactics  path of an int8 tactic table file (int8 weights' shapes)
Unset or empty leaves the default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from .linear_tactics import PACKAGED_INT8_LINEAR_TACTICS, PACKAGED_LINEAR_TACTICS, LinearTactics

__all__ = ["ENV_SWITCHES", "KERNEL_CONFIG_SCHEMA_VERSION", "KernelConfig"]

KERNEL_CONFIG_SCHEMA_VERSION = 1
# environment variable -> KernelConfig field
ENV_SWITCHES = {
    "TRTLLM_DUSTIN_PDL": "pdl",
    "TRTLLM_DUSTIN_FUSED_ELEMENTWISE": "fused_elementwise",
    "TRTLLM_DUSTIN_SKINNY_LINEAR": "skinny_linear",
    "TRTLLM_DUSTIN_SKINNY_PDL": "skinny_pdl",
    "TRTLLM_DUSTIN_SKINNY_TIES": "skinny_ties",
    "TRTLLM_DUSTIN_ROUND_KERNELS": "round_kernels",
    "TRTLLM_DUSTIN_INT8_WIDE": "int8_wide",
    "TRTLLM_DUSTIN_LINEAR_TACTICS": "linear_tactics",
    "TRTLLM_DUSTIN_INT8_LINEAR_TACTICS": "int8_linear_tactics",
}
_ON_OFF = {"1": True, "0": False}
# tactic table path field -> (the field it is loaded into, the weights its table must be of, the packaged table)
_TABLES = {
    "linear_tactics": ("tactics", "bf16", PACKAGED_LINEAR_TACTICS),
    "int8_linear_tactics": ("int8_tactics", "int8", PACKAGED_INT8_LINEAR_TACTICS),
}
_TABLE_OF = {weights: name for name, (_, weights, _) in _TABLES.items()}  # weights -> the path field of its table
_SWITCH_OF = {name: variable for variable, name in ENV_SWITCHES.items()}  # field -> its env switch


@dataclass(frozen=True)
class KernelConfig:
    # Programmatic dependent launch of the Triton kernels where supported (sm_90+, a Triton with launch_pdl).
    pdl: bool = True
    # The decoder's fused elementwise kernels (add + RMSNorm, RoPE + cache write, SiLU x up) and skinny GEMMs;
    # None: on for CUDA inputs in bf16 / fp16 / fp32, the module code otherwise.
    fused_elementwise: bool | None = None
    # Decode-sized projections on the skinny-M Triton GEMM for the shapes the tactic table lists (else F.linear).
    skinny_linear: bool = True
    # Launch that GEMM with PDL (also needs pdl).
    skinny_pdl: bool = True
    # PDL launches of that GEMM also take the table's tie shapes (within 1 % of cuBLAS without PDL).
    skinny_ties: bool = True
    # The row argmax and the round commit as Triton kernels (else their torch references).
    round_kernels: bool = True
    # A weight-only int8 projection called with more than INT8_WIDE_ROWS (64) rows (the int8 table's 128-row bucket:
    # the ring drafter's observe pass at B = 16) runs cuBLAS on a copy of its dequantized weight in the model's dtype,
    # kept beside the int8 one by drafters quantized while this is on (models/quantize.py, Int8Linear.keep_wide); the
    # skinny kernel reading int8 was slower than cuBLAS there in the H200 sweep. Costs the copy's memory. Off by
    # default: at B = 16 on an H100 the ring method's round took the same time either way (11.973 / 11.976 ms,
    # benchmarks/results/longspark2/README.md, twelfth step); not timed on the H200.
    int8_wide: bool = False
    # Path of the skinny-GEMM tactic table of bf16 / fp16 weights; None: the packaged H200 table
    # (tactics/skinny_linear_h200.json).
    linear_tactics: str | None = None
    # Path of the skinny-GEMM tactic table of weight-only int8 weights ("weights": "int8"); None: the packaged int8
    # table (tactics/skinny_linear_int8_h200.json).
    int8_linear_tactics: str | None = None
    # The tables at linear_tactics and int8_linear_tactics, loaded once here (not part of equality, hashing or the
    # JSON).
    tactics: LinearTactics = field(init=False, repr=False, compare=False)
    int8_tactics: LinearTactics = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("pdl", "skinny_linear", "skinny_pdl", "skinny_ties", "round_kernels", "int8_wide"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelConfig.{name}={value!r} must be True or False")
        if self.fused_elementwise is not None and not isinstance(self.fused_elementwise, bool):
            raise ValueError(f"KernelConfig.fused_elementwise={self.fused_elementwise!r} must be True, False or None")
        for name in _TABLES:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"KernelConfig.{name}={value!r} must be a file path or None (the packaged table)")
        for name, (loaded, weights, packaged) in _TABLES.items():
            path = packaged if getattr(self, name) is None else getattr(self, name)
            tactics = LinearTactics.load(path)
            if tactics.weights != weights:
                other = _TABLE_OF[tactics.weights]
                raise ValueError(f"KernelConfig.{name}={str(path)!r} is a table of {tactics.weights} weights "
                                 f"(\"weights\": \"{tactics.weights}\"); {name} ({_SWITCH_OF[name]}) takes one of "
                                 f"{weights} weights: pass this file as {other} ({_SWITCH_OF[other]})")
            object.__setattr__(self, loaded, tactics)

    @property
    def skinny_launch_pdl(self) -> bool:
        """Whether skinny-GEMM launches ask for PDL (granted where the device supports it)."""
        return self.pdl and self.skinny_pdl

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """The defaults with each TRTLLM_DUSTIN_* switch of `environ` (default: the process environment) applied."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for variable, name in ENV_SWITCHES.items():
            raw = environ.get(variable, "")
            if raw == "":
                continue
            if name in _TABLES:  # a path, taken as it is
                values[name] = raw
            elif raw in _ON_OFF:
                values[name] = _ON_OFF[raw]
            else:
                unset = " or unset it" + (" (None: on for CUDA inputs)" if name == "fused_elementwise" else "")
                raise ValueError(f"{variable}={raw!r} is not a valid value; accepted: '1' (on), '0' (off){unset}")
        return cls(**values)

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return json.dumps({"schema_version": KERNEL_CONFIG_SCHEMA_VERSION, **data}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> KernelConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("KernelConfig JSON must be an object")
        version = data.pop("schema_version", None)
        if version != KERNEL_CONFIG_SCHEMA_VERSION:
            raise ValueError(f"KernelConfig JSON has schema_version {version!r}; this build reads version "
                             f"{KERNEL_CONFIG_SCHEMA_VERSION}: write it again with this build "
                             "(KernelConfig.from_env().to_json()) or use the trtllm-dustin that wrote it")
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"KernelConfig JSON has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)
