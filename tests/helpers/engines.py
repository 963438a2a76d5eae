"""What the engine tests share (test_engines.py, test_pipeline_engine.py): the tiny pair, its limits and Dustin config,
and `build`, which builds an engine of them with any field changed."""

from __future__ import annotations

from pathlib import Path

from trtllm_dustin.build_engines.engine import EngineLimits, build_engine
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads

__all__ = ["DRAFT", "DUSTIN", "LIMITS", "TARGET", "build"]

TARGET, DRAFT = "preset:tiny-llama", "preset:tiny-llama-draft"
LIMITS = EngineLimits(max_batch=2, max_seq_len=96, gamma=3, dtype="float32")
DUSTIN = DustinConfig(target_layers=(LayerHeads(1, (0, 4)),), draft_layers=(LayerHeads(0, (1,)),), budget=24, m=4,
                      n_sink=4, n_recent=8, gamma=3)


def build(out: Path, **changes) -> Path:
    kwargs = dict(target=TARGET, draft=DRAFT, longspark="random", ring="random", dustin=DUSTIN, limits=LIMITS, seed=3,
                  log=None)
    return build_engine(out, **(kwargs | changes))
