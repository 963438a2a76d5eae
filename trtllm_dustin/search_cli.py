"""Command line of the offline search: `srh` (profile SRHs), `arr` (ARR analysis and plots), `search` (Algorithm 1).

`trtllm_dustin.cli` mounts these as `trtllm-dustin srh|arr|search`; `python -m trtllm_dustin.search_cli` runs them
on their own.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import ModelLoadError, load_model
from trtllm_dustin.provenance import Provenance
from trtllm_dustin.srh import SRHSettings, identify_srh

__all__ = ["add_srh_arguments", "build_parser", "main", "srh_command"]


def _device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    return device


def add_srh_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to profile (default: SmolLM2-135M); forms as in generate")
    parser.add_argument("--tokenizer-from", default=None,
                        help="load the tokenizer from this model instead (a draft preset uses its target's)")
    parser.add_argument("--out", type=Path, required=True, help="SRH JSON to write")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(SRHSettings.context_lengths),
                        help="prompt lengths in tokens (the issue asks for >= 10 up to the window)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(SRHSettings.depths),
                        help="needle depths in [0, 1] (the issue asks for >= 10 from 0 to 1)")
    parser.add_argument("--needles", type=int, default=SRHSettings.needles, help="distinct needles (>= 3)")
    parser.add_argument("--max-new-tokens", type=int, default=SRHSettings.max_new_tokens)
    parser.add_argument("--min-recall", type=float, default=SRHSettings.min_recall,
                        help="a test counts when the answer's ROUGE-1 recall is above this (-1: count every test)")
    parser.add_argument("--heads-per-layer", type=int, default=SRHSettings.heads_per_layer)
    parser.add_argument("--batch", type=int, default=SRHSettings.batch, help="prompts decoded together")
    parser.add_argument("--note", default="", help="stored in the JSON (e.g. 'random weights: meaningless')")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random-weight presets")


def srh_command(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    device = _device(args.device)
    provenance = Provenance.capture(device)
    settings = SRHSettings(context_lengths=tuple(args.lengths), depths=tuple(args.depths), needles=args.needles,
                           max_new_tokens=args.max_new_tokens, min_recall=args.min_recall,
                           heads_per_layer=args.heads_per_layer, batch=args.batch)
    loaded = load_model(args.model, device=device, seed=args.seed)
    tokenizer = loaded.tokenizer
    if args.tokenizer_from is not None:
        tokenizer = load_model(args.tokenizer_from, device="cpu").tokenizer
    if tokenizer is None:
        raise ConfigError(f"{loaded.source} has no tokenizer; pass --tokenizer-from with its target model")
    result = identify_srh(loaded.model, tokenizer, settings, note=args.note)
    result = replace(result, provenance=provenance.finished(time.perf_counter() - start).to_dict())
    result.save(args.out)
    print(f"{len(result.tests)} tests, {result.counted} counted (ROUGE-1 recall > {settings.min_recall}); "
          f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    if not result.layers:
        print("warning: no test counted, so no SRHs were chosen; lower --min-recall or shorten --lengths",
              file=sys.stderr)
    for lh in result.layers:
        print(f"  layer {lh.layer:2d}: heads {list(lh.heads)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trtllm_dustin.search_cli", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    srh = sub.add_parser("srh", help="identify semantic retrieval heads (needle-in-a-haystack profiling)")
    add_srh_arguments(srh)
    srh.set_defaults(func=srh_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ConfigError, ModelLoadError) as e:
        print(f"trtllm-dustin: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
