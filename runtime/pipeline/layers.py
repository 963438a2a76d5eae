"""Which target layers each pipeline stage holds: the one split that the engine builder writes its per-rank shards by
(build_engines/engine.py) and that the pipeline runtime checks its stages against (decoder.py)."""

from __future__ import annotations

from trtllm_dustin.config import ConfigError

__all__ = ["layer_split"]


def layer_split(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges of the pipeline stages, the first ones one layer longer when the layers
    do not divide evenly."""
    if not 1 <= pp_size <= num_layers:
        raise ConfigError(f"--pp-size {pp_size} must be between 1 and the target's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    bounds, start = [], 0
    for rank in range(pp_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
