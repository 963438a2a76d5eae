"""Load time: models from their sources (checkpoint parse, conversion) against the same models from an engine.

    python benchmarks/bench_engine_load.py --engine ENGINE [--model TARGET] [--draft DRAFT] [--device cuda]

Each round loads the target (and the draft) twice, from the sources as `generate --model/--draft` does and from the
engine as `generate --engine` does (its checks, every file's sha256 included), alternating so that neither side
profits from the page cache alone; --reps rounds, medians. Weights are in the engine's dtype on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, environment, save_json

from trtllm_dustin.build_engines.engine import open_engine
from trtllm_dustin.models.loading import open_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def from_sources(target: str | None, draft: str | None, device: torch.device, dtype: torch.dtype) -> float:
    start = time.perf_counter()
    model = open_model(target).load(device, dtype).model
    if draft is not None:
        open_model(draft, seed=1).load(device, dtype, share_with=model)
    sync(device)
    return time.perf_counter() - start


def from_engine(directory: Path, device: torch.device, dtype: torch.dtype) -> float:
    start = time.perf_counter()
    engine = open_engine(directory, device=device)
    engine.target.load(device, dtype)
    if engine.draft is not None:
        engine.draft.load(device, dtype)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, required=True)
    parser.add_argument("--model", default=None, help="the engine's target source (default: the default SmolLM2)")
    parser.add_argument("--draft", default=None, help="the engine's draft source, if it has one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    manifest = open_engine(args.engine, device=device).manifest
    dtype = manifest.limits.torch_dtype
    sources, engine = [], []
    for _ in range(args.reps):
        sources.append(from_sources(args.model, args.draft, device, dtype))
        engine.append(from_engine(args.engine, device, dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"engine": str(args.engine), "sources": manifest.sources, "device": str(device),
              "dtype": manifest.limits.dtype, "from_sources_s": sources, "from_engine_s": engine,
              "median_sources_s": statistics.median(sources), "median_engine_s": statistics.median(engine)}
    print(f"load from the sources {result['median_sources_s']:.2f} s, from the engine {result['median_engine_s']:.2f} s"
          f" (medians of {args.reps})")
    save_json(args.out or RESULTS / "engines" / f"load_{args.engine.name}.json", {**environment(), **result})


if __name__ == "__main__":
    main()
