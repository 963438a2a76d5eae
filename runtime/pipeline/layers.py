"""Which target layers each pipeline stage holds: the one split that the engine builder writes its per-rank shards by
(build_engines/engine.py) and that the pipeline runtime checks its stages against (decoder.py).

The first stage also drafts (the draft model or LongSpark, the estimate and the selection), so a split may give it
fewer target layers than the others (`first`), which balances the stages when the draft's time is comparable to a
few target layers'."""

from __future__ import annotations

from collections.abc import Sequence

from trtllm_dustin.config import ConfigError

__all__ = ["balanced_first_stage", "check_split", "layer_split"]


def layer_split(num_layers: int, pp_size: int, first: int | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges of the pipeline stages. first None: an even split, the first stages one
    layer longer when the layers do not divide evenly; first = n: the first stage (the drafting rank) holds n layers
    and the others split the rest evenly."""
    if not 1 <= pp_size <= num_layers:
        raise ConfigError(f"--pp-size {pp_size} must be between 1 and the target's {num_layers} layers")
    if first is None:
        return _even(0, num_layers, pp_size)
    if pp_size == 1:
        if first != num_layers:
            raise ConfigError(f"--first-stage-layers {first}: one stage holds all {num_layers} layers; drop the "
                              "option or raise --pp-size")
        return [(0, num_layers)]
    most = num_layers - (pp_size - 1)
    if not 1 <= first <= most:
        raise ConfigError(f"--first-stage-layers {first} must be between 1 and {most} (the target's {num_layers} "
                          f"layers, at least one for each of the other {pp_size - 1} stages)")
    return [(0, first)] + _even(first, num_layers, pp_size - 1)


def _even(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(stop - start, parts)
    bounds = []
    for rank in range(parts):
        end = start + base + (1 if rank < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_split(split: Sequence[Sequence[int]], num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """A split given whole (an engine's manifest, PipelineSetup.layers): pp_size contiguous non-empty ranges that
    cover [0, num_layers) in order; returned as tuples."""
    ranges = [tuple(int(x) for x in r) for r in split]
    ok = len(ranges) == pp_size and all(len(r) == 2 and r[0] < r[1] for r in ranges) and ranges[0][0] == 0 \
        and ranges[-1][1] == num_layers and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    if not ok:
        raise ConfigError(f"layer split {ranges} is not {pp_size} contiguous non-empty ranges covering the target's "
                          f"{num_layers} layers (runtime/pipeline/layers.py layer_split gives one)")
    return ranges


def balanced_first_stage(num_layers: int, pp_size: int, first_extra_ms: float, layer_ms: float,
                         last_extra_ms: float = 0.0) -> int:
    """The first stage's layer count that best balances the stages, from a measured round: one target layer's
    forward (`layer_ms`), the first stage's own work besides its layers (drafting and selection, `first_extra_ms`)
    and the last stage's (the output head and acceptance, `last_extra_ms`). A stage's time is its layers' plus its
    extra; the count minimises the slowest stage (ties: the larger count, nearer the even split)."""
    if pp_size < 2:
        return num_layers
    if min(first_extra_ms, last_extra_ms) < 0 or layer_ms <= 0:
        raise ValueError(f"balanced_first_stage: the extras ({first_extra_ms}, {last_extra_ms} ms) must be >= 0 and "
                         f"layer_ms {layer_ms} > 0")

    def slowest(first: int) -> float:
        split = layer_split(num_layers, pp_size, first)
        times = [(b - a) * layer_ms for a, b in split]
        times[0] += first_extra_ms
        times[-1] += last_extra_ms
        return max(times)

    counts = range(1, num_layers - pp_size + 2)
    return min(counts, key=lambda n: (slowest(n), -n))
