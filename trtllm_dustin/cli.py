"""Command line: `trtllm-dustin generate` (with no arguments: SmolLM2-135M-Instruct, the embedded default).

This module imports only the standard library and the torch-free validation layer at the top: `generate` parses
and checks its options (validation.py) and prints what it loads, from where and onto which device before torch,
triton and transformers are imported (about 3 s on a CPU host), then opens every model (configs and tokenizer, no
weights), checks every limit against the configs, and only then reads weights.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from trtllm_dustin.paths import OUTPUTS, check_output, check_paths
from trtllm_dustin.validation import (
    DEFAULT_PREFILL_BUDGET,
    MAX_GAMMA,
    RANGES,
    InputError,
    check_budget,
    check_drafter_options,
    check_dustin_config_used,
    check_generate_options,
    check_options,
    method_facts,
    sparse_gather_bytes,
)

if TYPE_CHECKING:  # annotations only: the imports themselves wait until a command needs them
    import torch

    from trtllm_dustin.build_engines.engine import OpenedEngine
    from trtllm_dustin.dustin_config import DustinConfig
    from trtllm_dustin.models.decoder import Transformer
    from trtllm_dustin.models.loading import Checkpoint, LoadedModel

__all__ = ["build_parser", "main"]

DEFAULT_PROMPT = "Write three sentences about why lighthouses were important to sailors."
DEFAULT_LONG_TOKENS = 1536  # speculative methods' default prompt: this much of a packaged book
DEFAULT_GAMMA = 3  # generate's draft tokens per round without an engine (an engine's: the gamma it was built with)
_DTYPE_NAMES = ("bfloat16", "float16", "float32")  # torch dtypes of --dtype
_DRAFT_WEIGHTS_HELP = ("the draft model's layers (and the ring drafter's layers and head): model (its dtype) or int8 "
                       "(weight-only, one scale per output row: half the bytes a draft step reads; tau within about "
                       "1 %% on the real pair)")


def _method_list() -> str:
    from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS

    return "; ".join(f"{name}: {METHODS[name].about}" for name in OFFERED_METHODS)


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown choice, a value that is no number, a missing option) in one line that
    says where the rest is, instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


class DefaultsHelp(argparse.HelpFormatter):
    """--help shows every option's default: appended to its help unless the help already says what it is (a default
    of None is explained there), and an option without help gets its default as its help; flags are off."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = f"default: {_typed(action.default)}"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return f"{text} (default: {_typed(action.default)})" if "default" not in text and \
            self._shows_default(action) else text

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.nargs != 0 and not action.required and \
            action.default is not argparse.SUPPRESS


def _typed(default: object) -> str:
    """A default as it is typed on the command line (a list: its values), escaped for argparse's %-expansion."""
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default))
    return '""' if default == "" else str(default).replace("%", "%%")


def _add_generate_arguments(gen: argparse.ArgumentParser, methods: Sequence[str] | None,
                            draft_kv_choices: Sequence[str] | None, method_help: str = "",
                            default_longspark: str = "", draft_weights: Sequence[str] | None = None,
                            default_ring: str = "") -> None:
    """generate's options. Built twice: by build_parser, and before torch is imported by `_early_generate_args`
    with the method names read from the registry's source (validation.method_facts) and the choices that need torch
    (draft_kv_choices, draft_weights) left open (None: the full parser checks them)."""
    gen.add_argument("--model", default=None, help="Hugging Face checkpoint directory, .gguf file, or preset:NAME "
                     "(default: SmolLM2-135M-Instruct, the embedded one)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", choices=_DTYPE_NAMES, default=None,
                     help="weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text (default: a short instruction; for speculative "
                        "methods the opening of a validation-split book from the installed corpora)")
    prompt.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from this file (default: "
                        "none, the --prompt default)")
    prompt.add_argument("--prompt-tokens", type=int, default=None,
                        help="random prompt of this many token ids (for presets, which have no tokenizer; default: "
                        "none, a text prompt)")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    gen.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (the prompt repeated)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per sequence, at most")
    gen.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: prompt + new tokens "
                     "+ gamma)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass, in (0, 1]")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (and the weights seed of presets)")
    gen.add_argument("--backend", choices=["reference", "triton"], default=None,
                     help="attention backend (default: triton on cuda, reference on cpu)")
    gen.add_argument("--no-cuda-graph", action="store_true", help="run decode steps eagerly on cuda")
    gen.add_argument("--method", choices=methods, default="vanilla", metavar="METHOD",
                     help="decoding method (default: vanilla): " + method_help)
    gen.add_argument("--draft", default=None, help="draft model for speculative methods (same forms as --model; "
                     "default with the default model: its packaged distilled draft)")
    gen.add_argument("--longspark", default=None, help="LongSpark drafter for the longspark methods: a directory "
                     "from `train-longspark`, or random (random weights, for presets) (default with the default "
                     f"model: the packaged {default_longspark})")
    gen.add_argument("--ring", default=None, help="ring drafter for the ring methods: a directory from "
                     "`train-ring-drafter`, or random (random weights, for presets) (default with the default model: "
                     f"the packaged {default_ring})")
    gen.add_argument("--gamma", type=int, default=None, help=f"draft tokens per speculative round, 1..{MAX_GAMMA} "
                     f"(default: {DEFAULT_GAMMA}; with --engine, the engine's)")
    gen.add_argument("--draft-budget", type=int, default=512, help="MagicDec: the draft's StreamingLLM KV budget; "
                     "streamingllm, snapkv, quest without a Dustin config: their k")
    gen.add_argument("--draft-kv-cache", choices=draft_kv_choices, default="model",
                     help="the draft's KV cache dtype: the model's, or fp8 (e4m3, half the draft's cache reads; "
                          "only the acceptance rate can change, the target's cache stays in --dtype)")
    gen.add_argument("--draft-weights", choices=draft_weights, default="model", help=_DRAFT_WEIGHTS_HELP)
    gen.add_argument("--dustin-config", type=Path, default=None,
                     help="Dustin estimator config (JSON written by `trtllm-dustin search`; default for the default "
                     "pair: the packaged one)")
    gen.add_argument("--budget", type=int, default=None,
                     help="k of the sparse methods, the cached positions each verification reads (default: the "
                     "Dustin config's, m carried over as the same share of the free slots; without a Dustin config "
                     "--draft-budget)")
    gen.add_argument("--profile", action="store_true", help="time each phase of a round with device events")
    gen.add_argument("--engine", type=Path, default=None,
                     help="an engine directory from `trtllm-dustin build`: its models, Dustin config, LongSpark "
                     "and ring drafters, dtype, draft KV cache and draft weights, and kernel tactics (instead of "
                     "--model, --draft, --longspark, --ring, --dustin-config, --draft-kv-cache, --draft-weights); "
                     "an engine built with --pp-size N runs under `torchrun --nproc-per-node N` (docs/engines.md; "
                     "default: none)")
    gen.add_argument("--micro-batches", type=int, default=1, help="pipeline-parallel runs: the batch in this many "
                     "micro-batches in flight across the stages (>1: each sequence samples from its own generator, "
                     "seeded --seed + its index)")
    gen.add_argument("--pp-timeout", type=float, default=300.0, help="pipeline-parallel runs: seconds a stage waits "
                     "for another before the run stops with an error")


def build_parser() -> argparse.ArgumentParser:
    from trtllm_dustin.fetch import add_fetch_command
    from trtllm_dustin.models.longspark import DEFAULT_LONGSPARK
    from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS
    from trtllm_dustin.models.ring_drafter import DEFAULT_RING
    from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES
    from trtllm_dustin.runtime.methods import OFFERED_METHODS
    from trtllm_dustin.search.cli import add_commands as add_search_commands

    parser = _Parser(prog="trtllm-dustin", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (vanilla or speculative decoding)",
                         formatter_class=DefaultsHelp)
    _add_generate_arguments(gen, OFFERED_METHODS, DRAFT_KV_CHOICES, _method_list(), DEFAULT_LONGSPARK, DRAFTER_WEIGHTS,
                            DEFAULT_RING)
    gen.set_defaults(func=_generate)

    build = sub.add_parser("build", help="build an engine directory: models converted, checked, split into pipeline "
                           "stages and tuned (docs/engines.md)", formatter_class=DefaultsHelp)
    build.add_argument("--out", type=Path, required=True, help="engine directory (must not exist, unless --force)")
    build.add_argument("--model", default=None, help="target: checkpoint directory, .gguf file or preset:NAME; "
                       "None: SmolLM2-135M-Instruct")
    build.add_argument("--draft", default=None, help="draft model (same forms; smollm2-draft: the packaged one); "
                       "None: no draft")
    build.add_argument("--longspark", default=None, help="LongSpark drafter directory, smollm2-longspark (packaged) "
                       "or random; None: none")
    build.add_argument("--ring", default=None, help=f"ring drafter directory, {DEFAULT_RING} (packaged) or random; "
                       "None: none")
    build.add_argument("--dustin-config", type=Path, default=None, help="the search's Dustin config for the pair; "
                       "None: none (the engine then serves no dustin method)")
    build.add_argument("--max-batch", type=int, default=16, help="batch slots the engine serves")
    build.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length per slot")
    build.add_argument("--gamma", type=int, default=3, help="draft tokens per speculative round")
    build.add_argument("--budget", type=int, default=None, help="Dustin's k; None: the Dustin config's")
    build.add_argument("--dtype", choices=_DTYPE_NAMES, default="bfloat16", help="weights and the target's KV cache")
    build.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model", help="the draft's KV cache")
    build.add_argument("--draft-weights", choices=DRAFTER_WEIGHTS, default="model", help=_DRAFT_WEIGHTS_HELP + "; "
                       "recorded in the manifest, the draft stored as it is and rounded when loaded")
    build.add_argument("--pp-size", type=int, default=1, help="pipeline stages (contiguous target layers per rank)")
    build.add_argument("--first-stage-layers", type=int, default=None, help="target layers of the first stage, which "
                       "also drafts (the others split the rest evenly); None: an even split")
    build.add_argument("--tune", action="store_true", help="measure the kernel tactics on this GPU (else the "
                       "packaged table is recorded)")
    build.add_argument("--seed", type=int, default=0, help="weights seed of presets (the draft's: seed + 1)")
    build.add_argument("--force", action="store_true", help="replace an existing --out (once the new one is complete)")
    build.add_argument("--device", default=None, help="where the weights are converted (presets initialised); None: "
                       "cuda when available, else cpu")
    build.set_defaults(func=_build)

    repo = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository (docs/serving.md)",
                          formatter_class=DefaultsHelp)
    repo.add_argument("--out", type=Path, required=True, help="repository directory (created; other models kept)")
    repo.add_argument("--name", default="dustin", help="model name inside the repository")
    repo.add_argument("--model", default=None,
                      help="Hugging Face checkpoint directory, .gguf file, or preset:NAME (default: SmolLM2-135M)")
    repo.add_argument("--draft", default=None, help="draft model for speculative methods (same forms as --model); "
                      "None with the default model: its packaged distilled draft")
    repo.add_argument("--method", nargs="+", choices=OFFERED_METHODS, default=["vanilla"], metavar="METHOD",
                      help="methods served, each with its own KV caches; the first is the default of a request "
                      "(default: vanilla); one or more of " + ", ".join(OFFERED_METHODS))
    repo.add_argument("--dustin-config", type=Path, default=None,
                      help="Dustin estimator config (JSON written by `trtllm-dustin search`), copied into the repo; "
                      "None for the default pair: the packaged one")
    repo.add_argument("--budget", type=int, default=None,
                      help="Dustin's k for the served dustin methods (default: the Dustin config's; m is carried over "
                      "as the same share of the free slots)")
    repo.add_argument("--max-batch", type=int, default=8, help="batch slots per method (in-flight batching)")
    repo.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length: prompt + max_tokens (+ gamma)")
    repo.add_argument("--queue-size", type=int, default=64, help="requests waiting for a slot before refusing more")
    repo.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill forward")
    repo.add_argument("--prefill-budget", type=int, default=DEFAULT_PREFILL_BUDGET,
                      help="prompt tokens prefilled per scheduler step over the waiting requests, oldest first, the "
                      "chunks of several in one forward, beside the running requests' decode round (0: one chunk "
                      "per step, a prompt of one chunk prefilled alone at its admission)")
    repo.add_argument("--prefix-cache-mib", type=int, default=0,
                      help="MiB per method of prompt-prefix K/V kept for reuse by later prompts that start the same "
                      "way (least recently used evicted); 0: no prefix caching")
    repo.add_argument("--prefix-block", type=int, default=256,
                      help="prefix caching's granularity: prompts share cached K/V in whole blocks of this many tokens")
    repo.add_argument("--device", default="cpu", help="cpu or cuda")
    repo.add_argument("--dtype", choices=_DTYPE_NAMES, default=None,
                      help="weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)")
    repo.add_argument("--backend", choices=["reference", "triton"], default=None,
                      help="attention backend (default: triton on cuda, reference on cpu)")
    repo.add_argument("--longspark", default=None, help="LongSpark drafter for the longspark methods: a directory, "
                      f"or random (default with the default model: the packaged {DEFAULT_LONGSPARK})")
    repo.add_argument("--ring", default=None, help="ring drafter for the ring methods: a directory, or random "
                      f"(default with the default model: the packaged {DEFAULT_RING})")
    repo.add_argument("--gamma", type=int, default=None, help=f"draft tokens per speculative round (default: "
                      f"{DEFAULT_GAMMA}; with --engine, the engine's)")
    repo.add_argument("--draft-budget", type=int, default=512, help="MagicDec: the draft's StreamingLLM KV budget")
    repo.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model",
                      help="the draft's KV cache dtype: the model's, or fp8 (e4m3, half the draft's cache reads)")
    repo.add_argument("--draft-weights", choices=DRAFTER_WEIGHTS, default="model", help=_DRAFT_WEIGHTS_HELP)
    repo.add_argument("--no-cuda-graph", action="store_true", help="run decode phases eagerly on cuda")
    repo.add_argument("--no-decoupled", action="store_true",
                      help="plain request/response model (HTTP infer; no streaming, batches per execute call)")
    repo.add_argument("--chat-template", action="store_true", help="wrap text_input in the tokenizer's chat template")
    repo.add_argument("--seed", type=int, default=0, help="weights seed of random presets (the draft's is seed + 1)")
    repo.add_argument("--engine", type=Path, default=None, help="serve an engine directory from `trtllm-dustin "
                      "build` (its models, Dustin config, LongSpark and ring drafters, dtype and tactics; stored as an "
                      "absolute path); None: the models named by the options above")
    repo.set_defaults(func=_triton_repo)

    serve = sub.add_parser("serve", help="serve a repository from triton-repo (the OpenAI API, Triton's HTTP and gRPC "
                           "APIs, /metrics) until Ctrl-C / SIGTERM", formatter_class=DefaultsHelp)
    serve.add_argument("--repo", type=Path, required=True, help="the model repository (`trtllm-dustin triton-repo`)")
    serve.add_argument("--address", default="127.0.0.1",
                       help="interface the HTTP and gRPC endpoints bind (0.0.0.0: every interface)")
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port of the front: the OpenAI API, Triton's "
                       "HTTP API and /metrics (0: any free port); tritonserver's own HTTP listens on 127.0.0.1 only")
    serve.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: any free port)")
    serve.add_argument("--server-dir", type=Path, default=Path.home() / ".cache" / "trtllm-dustin" / "tritonserver",
                       help="where nvidia-pytriton's server is prepared (once) with this Python's backend stub")
    serve.add_argument("--log", type=Path, default=None, help="server log file; None: serve.log in the repository "
                       "(Triton loads its directories only)")
    serve.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the models to load")
    serve.add_argument("--drain", type=float, default=10.0,
                       help="at Ctrl-C / SIGTERM: seconds the running requests get to finish before they are cut "
                            "(with an error that says so); waiting ones are refused at once")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                       help="HTTP bodies over this size are refused (413) before they are read")
    serve.add_argument("--max-json-depth", type=int, default=32,
                       help="HTTP bodies whose JSON nests deeper are refused (400) before anything parses them")
    serve.set_defaults(func=_serve)

    add_search_commands(sub, DefaultsHelp)
    add_fetch_command(sub)

    prep = sub.add_parser("prepare-distill-data", help="tokenise train-split windows for draft distillation",
                          formatter_class=DefaultsHelp)
    prep.add_argument("--out", type=Path, required=True, help="output .npy (uint16 [windows, seq_len])")
    prep.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
    prep.add_argument("--max-windows", type=int, default=None, help="stop after this many windows; None: all")
    prep.set_defaults(func=_prepare_distill_data)

    regen = sub.add_parser("regenerate-data", help="training windows whose tails the target wrote: each window's "
                           "first --context tokens, then --new tokens sampled from the frozen target (GPU "
                           "recommended; resumable: rerun the same command)", formatter_class=DefaultsHelp)
    regen.add_argument("--tokens", type=Path, required=True, help="file from prepare-distill-data")
    regen.add_argument("--out", type=Path, required=True,
                       help="output .npy ([windows, context + new], the input's dtype); OUT.json: its record")
    regen.add_argument("--context", type=int, default=None,
                       help="tokens of each window kept as the prompt; None: the window's length - --new")
    regen.add_argument("--new", type=int, default=512, help="tokens the target writes after them")
    regen.add_argument("--temperature", type=float, default=0.7, help="the target's sampling temperature")
    regen.add_argument("--top-p", type=float, default=0.8, help="the target's nucleus")
    regen.add_argument("--batch-size", type=int, default=8, help="windows generated together")
    regen.add_argument("--seed", type=int, default=0, help="batch b samples from seed + b")
    regen.add_argument("--max-windows", type=int, default=None, help="the first this many windows; None: all")
    regen.add_argument("--target", default=None, help="target model; None: SmolLM2-135M-Instruct")
    regen.add_argument("--device", default=None, help="cuda or cpu; None: cuda when available")
    regen.set_defaults(func=_regenerate_data)

    train = sub.add_parser("train-draft", help="distil a draft from the target (GPU recommended)",
                           formatter_class=DefaultsHelp)
    train.add_argument("--tokens", type=Path, required=True, help="file from prepare-distill-data")
    train.add_argument("--out", type=Path, required=True, help="directory for checkpoint/, record and loss curve")
    train.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    for name, default, text in (("steps", 2000, "optimiser steps"), ("seq-len", 2048, "tokens per training window"),
                                ("batch-size", 8, "windows per step"), ("seed", 0, "initialisation and data order")):
        train.add_argument(f"--{name}", type=int, default=default, help=text)
    train.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument("--init-layers", default="0,10,20,29",
                       help="target blocks the draft starts from, comma-separated (empty: from scratch, --draft-shape)")
    train.add_argument("--head-vocab", type=int, default=16384,
                       help="output rows of a layer-subset draft: the most frequent train ids (0: whole vocabulary)")
    train.add_argument("--draft-shape", default="smollm2-draft-random", help="preset shape of a from-scratch draft")
    train.add_argument("--device", default=None, help="cuda or cpu; None: cuda when available")
    train.add_argument("--max-seconds", type=float, default=None, help="stop (and save) after this much training; "
                       "None: at --steps")
    train.set_defaults(func=_train_draft)

    from trtllm_dustin.training.longspark import LongSparkTrainConfig

    defaults = LongSparkTrainConfig()
    spark = _window_trainer(sub, "train-longspark", "train a LongSpark drafter against its frozen target", defaults,
                            (("window", "recent target KV rows per layer and head (W)"),
                             ("summary", "summary entries per layer and KV head (R)"),
                             ("block", "draft slots per block: the most tokens a round can propose"),
                             ("lora_rank", "rank of each block's adapters"),
                             ("fuse_rank", "rank of the boundary-state fusion (the hidden size: full rank)"),
                             ("markov_rank", "rank of the per-slot Markov (bigram) correction")), _train_longspark)
    spark.add_argument("--target-layers", default=",".join(map(str, defaults.target_layers)),
                       help="target layers read, one drafter block each")
    spark.add_argument("--anchor-from", type=int, default=defaults.anchor_from,
                       help="anchors only at positions >= this (windows from regenerate-data: its --context, the "
                       "part the target wrote); 1: the whole window")
    spark.add_argument("--position-decay", type=float, default=defaults.position_decay,
                       help="draft slot g's loss weighted by this ** g (acceptance is a prefix product); 1: alike")

    from trtllm_dustin.training.ring_drafter import RingTrainConfig

    defaults = RingTrainConfig()
    ring = _window_trainer(sub, "train-ring-drafter", "train a ring drafter (own layers over a fixed ring of recent "
                           "positions, fed with the target's hidden states) against its frozen target", defaults,
                           (("window", "ring rows each position and slot attends to (W)"),
                            ("block", "the most tokens a round proposes"),
                            ("causal_stride", "ring-pass positions between scored ones")), _train_ring_drafter)
    ring.add_argument("--read-layers", default=",".join(map(str, defaults.read_layers)),
                      help="target layers whose hidden states feed each position")
    ring.add_argument("--own-layers", default=",".join(map(str, defaults.own_layers)),
                      help="target layers copied as the drafter's own layers at the start (their count: its depth)")
    ring.add_argument("--init", default=None,
                      help="start from this trained ring drafter's weights instead of the copied layers: a "
                      "checkpoint directory train-ring-drafter wrote, or smollm2-ring (the packaged one); its layers, "
                      "window and block must be this run's. A longer training in more device sessions: --init the "
                      "last one's checkpoint, with another --seed for other windows")
    return parser


def _window_trainer(sub, name: str, about: str, defaults, own: tuple[tuple[str, str], ...], func
                    ) -> argparse.ArgumentParser:
    """A training command over token windows (training/windows.py): the options every such drafter takes, after its
    own integer options `own` (name, help), with the defaults of its config."""
    parser = sub.add_parser(name, help=f"{about} (GPU; resumable: rerun with the same --out)",
                            formatter_class=DefaultsHelp)
    parser.add_argument("--tokens", type=Path, required=True, help="file from prepare-distill-data (train split)")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for checkpoint/, resume.pt, the training record and the loss curve")
    parser.add_argument("--target", default=None, help="target model; None: SmolLM2-135M-Instruct")
    for option, text in (*own, ("seq_len", "tokens per training window"), ("batch_size", "windows per step"),
                         ("anchor_stride", "positions between anchors"),
                         ("steps", "optimiser steps (a --max-seconds budget usually ends the run first)"),
                         ("seed", "initialisation, data order and anchors")):
        parser.add_argument(f"--{option.replace('_', '-')}", type=int, default=getattr(defaults, option), help=text)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate (cosine decay)")
    parser.add_argument("--device", default=None, help="cuda or cpu; None: cuda when available")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop (and save) after this much training; "
                        "None: at --steps")
    parser.add_argument("--stop-after", type=float, default=None, help="end this run after this many seconds, to be "
                        "resumed by the same command (the cosine still spans --max-seconds); None: no such end")
    parser.set_defaults(func=func)
    return parser


def _prepare_distill_data(args: argparse.Namespace) -> int:
    from trtllm_dustin.models.loading import open_model
    from trtllm_dustin.training.distill import prepare_tokens

    tokenizer = open_model(None).tokenizer  # the default's tokenizer; its weights are not needed
    summary = prepare_tokens(tokenizer, args.out, args.seq_len, max_windows=args.max_windows)
    print(json.dumps(summary, indent=2))
    return 0


def _regenerate_data(args: argparse.Namespace) -> int:
    import numpy as np

    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.training.regenerate import RegenerateConfig, regenerate_tokens

    context = args.context
    if context is None:
        length = np.load(args.tokens, mmap_mode="r").shape[-1]
        if length <= args.new:
            raise ConfigError(f"--new {args.new} leaves no context in {args.tokens}'s {length}-token windows; lower "
                              "--new or pass --context")
        context = length - args.new
    cfg = RegenerateConfig(context=context, new=args.new, temperature=args.temperature, top_p=args.top_p,
                           batch_size=args.batch_size, seed=args.seed, max_windows=args.max_windows)
    record = regenerate_tokens(args.tokens, args.out, cfg, target_spec=args.target,
                               device=args.device or _default_device())
    print(json.dumps(record, indent=2))
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.distill import DistillConfig, train_draft

    device = args.device or _default_device()
    layers = _layer_list(args.init_layers, "--init-layers")
    cfg = DistillConfig(seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                        seed=args.seed, warmup=min(100, args.steps // 10), init_layers=layers,
                        head_vocab=args.head_vocab if layers else 0, draft_shape=args.draft_shape)
    record = train_draft(args.tokens, args.out, cfg, target_spec=args.target, device=device,
                         max_seconds=args.max_seconds)
    print(json.dumps(record, indent=2))
    return 0


def _layer_list(text: str, option: str) -> tuple[int, ...]:
    """'0,10,20' -> (0, 10, 20), or a ConfigError naming the option."""
    from trtllm_dustin.config import ConfigError

    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise ConfigError(f"{option} {text!r}: give layer numbers separated by commas, e.g. 0,10,20,29") from None


def _train_longspark(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.longspark import LongSparkTrainConfig, train_longspark

    device = args.device or _default_device()
    cfg = LongSparkTrainConfig(target_layers=_layer_list(args.target_layers, "--target-layers"), window=args.window,
                               summary=args.summary, block=args.block,
                               lora_rank=args.lora_rank, fuse_rank=args.fuse_rank, markov_rank=args.markov_rank,
                               seq_len=args.seq_len, batch_size=args.batch_size,
                               anchor_stride=args.anchor_stride, steps=args.steps, lr=args.lr, seed=args.seed,
                               warmup=min(100, args.steps // 10), position_decay=args.position_decay,
                               anchor_from=args.anchor_from)
    cfg.drafter("")  # the drafter's own checks, before the target loads
    record = train_longspark(args.tokens, args.out, cfg, target_spec=args.target, device=device,
                             max_seconds=args.max_seconds, stop_after=args.stop_after)
    print(json.dumps(record, indent=2))
    return 0


def _train_ring_drafter(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.ring_drafter import RingTrainConfig, train_ring_drafter

    device = args.device or _default_device()
    cfg = RingTrainConfig(read_layers=_layer_list(args.read_layers, "--read-layers"),
                          own_layers=_layer_list(args.own_layers, "--own-layers"), window=args.window, block=args.block,
                          causal_stride=args.causal_stride, seq_len=args.seq_len, batch_size=args.batch_size,
                          anchor_stride=args.anchor_stride, steps=args.steps, lr=args.lr, seed=args.seed,
                          warmup=min(50, args.steps // 10), init=str(args.init or ""))
    record = train_ring_drafter(args.tokens, args.out, cfg, target_spec=args.target, device=device,
                                max_seconds=args.max_seconds, stop_after=args.stop_after)
    print(json.dumps(record, indent=2))
    return 0


def _long_text_prompt(tokenizer) -> list[int] | None:
    """Speculative methods' default prompt: the opening DEFAULT_LONG_TOKENS tokens of the first validation-split
    Gutenberg book of the installed corpora, as raw text to continue (None when the corpora are not installed)."""
    from trtllm_dustin.data import as_encoder, split_documents

    encode = as_encoder(tokenizer)
    try:
        for doc in split_documents("validation", ["shakespeare", "milton"]):
            ids = list(encode(doc.text))
            if len(ids) >= DEFAULT_LONG_TOKENS:
                print(f"prompt: the first {DEFAULT_LONG_TOKENS} tokens of {doc.doc_id} (validation split), continued")
                return ids[:DEFAULT_LONG_TOKENS]
    except (ImportError, OSError) as e:  # a corpus package is missing (CorpusNotInstalledError): the short prompt
        print(f"note: no packaged long text ({type(e).__name__}: {e}); using the short default prompt")
    return None


def _prompt_ids(args: argparse.Namespace, target: Checkpoint) -> list[int]:
    import torch

    from trtllm_dustin.runtime.methods import METHODS

    vocab = target.config.vocab_size
    if args.prompt_tokens is not None:
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
    if args.prompt_file is not None:
        text = args.prompt_file.read_text()
    elif args.prompt is None and METHODS[args.method].speculative and target.tokenizer is not None:
        long_text = _long_text_prompt(target.tokenizer)
        if long_text is not None:
            return long_text
        text = DEFAULT_PROMPT
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{target.source} has no tokenizer; pass --prompt-tokens N instead of a text prompt")
    if not args.raw and getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
    return tok.encode(text)


def _default_device() -> str:
    """cuda when torch sees a GPU, else cpu. A torch build without GPU support says so in its version file, read here
    without importing torch (2-3 s), so that the first line waits for nothing on a CPU host."""
    spec = importlib.util.find_spec("torch")
    version = Path(spec.origin).with_name("version.py") if spec is not None and spec.origin else None
    if version is not None and version.is_file():
        build = runpy.run_path(str(version))
        if build.get("cuda") is None and build.get("hip") is None:
            return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype_name(requested: str | None, device: str) -> str:
    return requested or ("bfloat16" if device.split(":")[0] == "cuda" else "float32")


def _early_generate_args(argv: list[str]) -> argparse.Namespace | None:
    """`generate`'s options, parsed and checked before the slow imports (torch, triton, transformers: about 3 s), so
    that a bad one is refused before the first line says what loads; None for another command or --help (the full
    parser then answers). A value argparse refuses exits here with generate's usage, as the full parser would."""
    if argv[:1] != ["generate"] or {"-h", "--help"} & set(argv):
        return None
    facts = method_facts()
    parser = _Parser(prog="trtllm-dustin generate")
    _add_generate_arguments(parser, None if facts is None else [n for n, f in facts.items() if f.offered], None)
    args = parser.parse_args(argv[1:])
    check_generate_options(args, facts)
    return args


def _loading_line(args: argparse.Namespace) -> str:
    """The first line of `generate`: what is loaded, from where, onto which device in which dtype (torch-free)."""
    from trtllm_dustin.models.errors import ModelLoadError
    from trtllm_dustin.models.packaged import DEFAULT_MODEL, default_gguf_path

    device = args.device or _default_device()
    what, dtype = args.model, _dtype_name(args.dtype, device)
    if getattr(args, "engine", None) is not None:
        what = f"the engine {args.engine}"
        try:  # its weights' dtype, which it runs in (opening it checks the manifest, and refuses another --dtype)
            dtype = args.dtype or json.loads((args.engine / "manifest.json").read_text())["limits"]["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            dtype = args.dtype or "the engine's dtype"
    elif args.model in (None, DEFAULT_MODEL):
        try:
            what = f"SmolLM2-135M-Instruct (the default model) from {default_gguf_path()}"
        except ModelLoadError:  # opening it raises this again, with the fix, once the error handler is in place
            what = "SmolLM2-135M-Instruct (the default model)"
    elif args.model.startswith("preset:"):
        what = f"{args.model} (random weights)"
    return f"trtllm-dustin generate: loading {what} onto {device} ({dtype})"


def _build(args: argparse.Namespace) -> int:
    from trtllm_dustin.build_engines.engine import EngineLimits, build_engine
    from trtllm_dustin.dustin_config import DustinConfig

    if args.budget is not None:
        if args.dustin_config is None:
            raise InputError(f"--budget {args.budget} sets the k of a Dustin config, and none is given; pass "
                             "--dustin-config FILE, or drop --budget")
        check_budget(args.budget, args.max_seq_len)
    limits = EngineLimits(max_batch=args.max_batch, max_seq_len=args.max_seq_len, gamma=args.gamma,
                          budget=args.budget, dtype=args.dtype, draft_kv_cache=args.draft_kv_cache,
                          draft_weights=args.draft_weights)
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    start = time.perf_counter()
    build_engine(args.out, target=args.model, draft=args.draft, longspark=args.longspark, ring=args.ring, dustin=dustin,
                 limits=limits, pp_size=args.pp_size, first_stage_layers=args.first_stage_layers, tune=args.tune,
                 seed=args.seed, force=args.force, device=args.device or _default_device())
    print(f"build took {time.perf_counter() - start:.1f} s; run it: trtllm-dustin generate --engine {args.out}")
    return 0


def _open_engine(args: argparse.Namespace, device, method, world_size: int = 1, rank: int = 0) -> OpenedEngine:
    """generate --engine: check the engine (format, every file's sha256, fingerprints) and the run against its limits,
    and take its models, drafter and dtype in place of the options that name them. A pipeline stage (rank of
    world_size) checks the files it reads."""
    from trtllm_dustin.build_engines.engine import EngineError, check_serves, open_engine

    given = [name for name in ("model", "draft", "longspark", "ring", "dustin_config")
             if getattr(args, name) is not None]
    if given:
        raise EngineError(f"--engine brings its own models and configs; drop --{given[0].replace('_', '-')}")
    engine = open_engine(args.engine, device=device, world_size=world_size, rank=rank)
    limits = engine.manifest.limits
    if args.dtype is not None and args.dtype != limits.dtype:
        raise EngineError(f"--dtype {args.dtype}: the engine's weights are {limits.dtype}; drop --dtype or rebuild")
    for name, asked, limit in (("batch-size", args.batch_size, limits.max_batch),
                               ("gamma", args.gamma or 0, limits.gamma),
                               ("max-seq-len", args.max_seq_len or 0, limits.max_seq_len)):
        if asked > limit:
            raise EngineError(f"--{name} {asked} exceeds the engine's {limit}; lower it or rebuild the engine with "
                              f"--{'max-batch' if name == 'batch-size' else name} {asked}")
    check_serves(engine, [args.method])
    if method.needs_longspark:
        args.longspark = str(engine.longspark)
    if method.needs_ring:
        args.ring = str(engine.ring)
    args.draft_kv_cache, args.draft_weights = limits.draft_kv_cache, limits.draft_weights
    print(f"engine: {args.engine} (checked: format {engine.manifest.format_version}, {len(engine.manifest.files)} "
          f"files' sha256, fingerprints; limits batch {limits.max_batch} x {limits.max_seq_len} tokens, gamma "
          f"{limits.gamma}; " + (f"kernel tactics {'tuned on' if engine.manifest.tuned else 'packaged for'} "
                                 f"{engine.manifest.tactics_gpu}" if device.type == "cuda" else
                                 "no kernel tactics on cpu: the PyTorch reference path") + ")", flush=True)
    for note in engine.notes:
        print(note, flush=True)
    given, args.gamma = args.gamma is not None, args.gamma or limits.gamma
    if method.speculative:
        print(f"{args.method}: gamma {args.gamma} draft tokens per round" + (
            f" (--gamma; the engine takes up to {limits.gamma})" if given else
            " (the engine's, built with --gamma; pass --gamma N for fewer)"), flush=True)
    return engine


def _open(role: str, spec: str | None, seed: int, engine: OpenedEngine | None = None) -> Checkpoint:
    """Open a model (config and tokenizer, no weights) and say what it is (from the engine, when one is given)."""
    from trtllm_dustin.models.loading import open_model

    start = time.perf_counter()
    checkpoint = (engine.target if role == "target" else engine.draft) if engine is not None else \
        open_model(spec, seed, "--model" if role == "target" else f"--{role}")
    c = checkpoint.config
    print(f"{role}: {c.name}, {c.num_layers} layers x {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads, vocab "
          f"{c.vocab_size}, {c.max_position_embeddings} positions, {c.num_parameters() / 1e6:.0f} M parameters; "
          f"{checkpoint.about}; opened in {time.perf_counter() - start:.1f} s", flush=True)
    return checkpoint


def _load(role: str, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
          share_with: Transformer | None = None) -> LoadedModel:
    start = time.perf_counter()
    loaded = checkpoint.load(device, dtype, share_with=share_with)
    print(f"{role}: weights loaded in {time.perf_counter() - start:.1f} s", flush=True)
    return loaded


def _draft_weights(draft: Transformer, kind: str) -> Transformer:
    """--draft-weights on the loaded draft (on its device, in its dtype), before a runtime is built on it or a CUDA
    graph captured: int8 rounds its layers' projections (models/quantize.py quantize_draft), and says so."""
    from trtllm_dustin.models.quantize import Int8Linear, quantize_draft

    quantize_draft(draft, kind)
    if kind != "model":
        rounded = sum(isinstance(m, Int8Linear) for m in draft.modules())
        print(f"draft: {rounded} projections of its {len(draft.layers)} layers in weight-only int8 (one scale per "
              "output row; the embedding, final norm and output head as loaded)", flush=True)
    return draft


def _check_limits(args: argparse.Namespace, prompt: list[int], lookahead: int, models: list[tuple[str, Checkpoint]],
                  kv_dtypes: list[torch.dtype], device: torch.device, dtype: torch.dtype,
                  shares: list[float] | None = None, sparse_k: int | None = None, drafter_bytes: int = 0,
                  engine_seq_len: int | None = None) -> int:
    """Every limit that the configs decide, before a weight is read: the KV cache length against the prompt and
    each model's positions, --budget against the cache, and the weights + caches (+ the sparse verification's gather
    at k, `sparse_k`, for a sparse method) against the device's free memory (shares: the fraction of each model this
    process holds, a pipeline stage's; default all; drafter_bytes: a ring drafter's own weights, counted with the
    weights; engine_seq_len: the cache length an engine was built for). Returns the cache length."""
    from trtllm_dustin.kv_cache import KVCache, available_memory, check_fits
    from trtllm_dustin.runtime.generation import check_lengths

    need = len(prompt) + args.max_new_tokens + lookahead
    max_seq_len = args.max_seq_len or need
    if lookahead:  # a speculative round writes gamma positions ahead: the cache grows to hold them
        max_seq_len = max(max_seq_len, need)
    if max_seq_len == args.max_seq_len:
        asked, fix = f"--max-seq-len {max_seq_len}", "lower it"
    else:
        asked = f"the prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens}" + \
            (f" + gamma {lookahead}" if lookahead else "") + f" = {max_seq_len}"
        fix = "shorten the prompt or lower --max-new-tokens"
    for role, checkpoint in models:
        positions = checkpoint.config.max_position_embeddings
        if max_seq_len > positions:
            raise ValueError(f"{asked} exceeds the {role}'s {positions} positions ({checkpoint.config.name}); {fix}")
    if engine_seq_len is not None and max_seq_len > engine_seq_len:
        raise ValueError(f"{asked} exceeds the {engine_seq_len} positions the engine was built for; {fix}, or "
                         f"rebuild the engine with --max-seq-len {max_seq_len}")
    check_lengths([prompt] * args.batch_size, args.batch_size, max_seq_len, args.max_new_tokens, lookahead)
    if sparse_k is not None and args.budget is not None:
        check_budget(args.budget, max_seq_len)
    shares = shares or [1.0] * len(models)
    weights = drafter_bytes + sum(int(share * checkpoint.config.num_parameters() * dtype.itemsize)
                                  for (_, checkpoint), share in zip(models, shares, strict=True))
    caches = sum(int(share * KVCache.nbytes_for(checkpoint.config, args.batch_size, max_seq_len, kv))
                 for (_, checkpoint), kv, share in zip(models, kv_dtypes, shares, strict=True))
    gather = 0 if sparse_k is None else _gather_bytes(models[0][1].config, args.batch_size, sparse_k, lookahead, dtype)
    what = f" + the sparse gather at k = {sparse_k} {gather / 2**30:.2f} GiB" if sparse_k is not None else ""
    check_fits(f"this run (weights {weights / 2**30:.2f} GiB + KV caches of {args.batch_size} x {max_seq_len} "
               f"tokens {caches / 2**30:.2f} GiB{what})", weights + caches + gather, device)
    positions = min(checkpoint.config.max_position_embeddings for _, checkpoint in models)
    print(f"checked: KV caches {args.batch_size} x {max_seq_len} tokens (<= {positions} positions), weights + caches "
          f"{'+ gather ' if gather else ''}{(weights + caches + gather) / 2**30:.2f} GiB of "
          f"{available_memory(device) / 2**30:.1f} GiB free on {device}", flush=True)
    return max_seq_len


def _gather_bytes(config, batch: int, k: int, gamma: int, dtype: torch.dtype) -> int:
    """A sparse verification's per-layer transient at k (validation.sparse_gather_bytes) for the target `config`."""
    return sparse_gather_bytes(batch, k, gamma + 1, config.num_heads, config.num_kv_heads, config.head_dim,
                               dtype.itemsize)


def _sparse_k(args: argparse.Namespace, method, dustin: DustinConfig | None) -> int | None:
    """The k a sparse method verifies with (None: it verifies in full): the Dustin config's, else --draft-budget
    (the baselines'; _baseline_budgets put --budget there)."""
    if not method.sparse:
        return None
    return dustin.budget if dustin is not None else args.draft_budget


def _generate(args: argparse.Namespace) -> int:
    import torch

    from trtllm_dustin.models.longspark import load_longspark
    from trtllm_dustin.models.ring_drafter import load_ring_drafter, ring_weight_bytes
    from trtllm_dustin.plugins.kernel_config import KernelConfig
    from trtllm_dustin.plugins.kv_dtype import draft_kv_dtype
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig
    from trtllm_dustin.runtime.methods import METHODS
    from trtllm_dustin.runtime.pipeline import torchrun_world
    from trtllm_dustin.runtime.sampling import SamplingParams

    device = torch.device(args.device or _default_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    dtype = getattr(torch, _dtype_name(args.dtype, device.type))
    if torchrun_world() > 1:  # one stage of a pipeline-parallel engine
        return _generate_pipeline(args)
    if args.micro_batches != 1:
        raise ValueError(f"--micro-batches {args.micro_batches} splits a pipeline-parallel run; a single process "
                         "decodes the batch at once (drop it, or run a --pp-size engine under torchrun)")
    method = METHODS[args.method]
    speculative = method.speculative

    # ---- open every model (configs, tokenizer) and check every limit; no weight is read yet
    engine = _open_engine(args, device, method) if args.engine is not None else None
    if args.gamma is None:
        args.gamma = DEFAULT_GAMMA
    if engine is not None:
        dtype = engine.manifest.limits.torch_dtype
    target = _open("target", args.model, args.seed, engine)
    draft, dustin = _open_drafters(args, [args.method], target, engine)
    models, kv_dtypes = [("target", target)], [dtype]
    if draft is not None:
        models.append(("draft", draft))
        kv_dtypes.append(draft_kv_dtype(args.draft_kv_cache, dtype))
    prompt = _prompt_ids(args, target)
    lookahead = args.gamma if speculative else 0
    max_seq_len = _check_limits(args, prompt, lookahead, models, kv_dtypes, device, dtype,
                                sparse_k=_sparse_k(args, method, dustin),
                                drafter_bytes=ring_weight_bytes(args.ring, target.config, dtype.itemsize)
                                if method.needs_ring else 0,
                                engine_seq_len=engine.manifest.limits.max_seq_len if engine is not None else None)

    # ---- load the weights
    loaded = _load("target", target, device, dtype)
    draft_model = _load("draft", draft, device, dtype, share_with=loaded.model).model if draft is not None else None
    if draft_model is not None:
        _draft_weights(draft_model, args.draft_weights)
    longspark = load_longspark(args.longspark, loaded.model, seed=args.seed + 1) if method.needs_longspark else None
    kernels = KernelConfig.from_env()  # the TRTLLM_DUSTIN_* switches, read once
    ring = load_ring_drafter(args.ring, loaded.model, weights=args.draft_weights, seed=args.seed + 2,
                             wide=kernels.int8_wide) if method.needs_ring else None
    config = loaded.model.config
    decoder = build_runtime(  # an engine brings its own (tuned) tactic table
        args.method, loaded.model, draft=draft_model, longspark=longspark, ring=ring, dustin=dustin,
        batch_slots=args.batch_size,
        max_seq_len=max_seq_len, dtype=dtype, draft_kv_dtype=kv_dtypes[1] if draft_model is not None else None,
        device=device, kernels=kernels, tactics=engine.tactics if engine is not None else None,
        backend=args.backend, gamma=args.gamma, draft_budget=args.draft_budget, use_cuda_graph=not args.no_cuda_graph)
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=config.eos_token_ids,
                                  sampling=SamplingParams(args.temperature, args.top_p, args.seed))
    prompts = [prompt] * args.batch_size
    result = decoder.generate(prompts, gen_config, profile=args.profile)
    _print_result(args, result, loaded.tokenizer, loaded.source, device, dtype, len(prompt))
    return 0


def _print_result(args: argparse.Namespace, result, tokenizer, source: str, device, dtype, prompt_tokens: int
                  ) -> None:
    """generate's report: each sequence's text, then the run's sizes, times and acceptance."""
    from trtllm_dustin.runtime.methods import METHODS

    speculative = METHODS[args.method].speculative
    for i, ids in enumerate(result.tokens):
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else str(ids)
        print(f"[{i}] {text}")
    steps = "rounds" if speculative else "steps"
    print(f"model {source} on {device} ({str(dtype).removeprefix('torch.')}), batch {args.batch_size}, "
          f"prompt {prompt_tokens} tokens, generated {result.generated} tokens")
    setup = "" if device.type != "cuda" else \
        f", then {result.setup_ms:.1f} ms of one-time setup (CUDA-graph capture, kernel warm-up)"
    print(f"time to first token {result.prefill_ms:.1f} ms (prefill){setup}")
    idle = result.rounds - result.decoding_rounds  # GPU only: rounds until the finished flag reached the host
    if result.generated == len(result.tokens):  # every sequence ended at the token the prefill wrote
        print(f"decode: no {steps} ran (every sequence ended at its first token, which the prefill writes: an "
              "end-of-sequence token or --max-new-tokens 1)")
    else:
        print(f"decode {result.decode_tokens_per_s:.1f} tokens/s ({result.decoding_rounds} {steps} in "
              f"{result.decoding_ms:.1f} ms" + (f"; then {idle} idle {steps} until the finished flag reached the "
                                                 f"host, {result.decode_ms:.1f} ms in all)" if idle else ")"))
    if speculative and sum(result.committed_hist):
        print(f"{args.method}: gamma {args.gamma}, mean accepted length tau {result.tau:.2f}, "
              f"tokens committed per round (1..{args.gamma + 1}): {result.committed_hist}")
    if result.phase_ms:
        print("phases (ms, whole run): " + ", ".join(f"{k} {v:.1f}" for k, v in result.phase_ms.items()))


def _generate_pipeline(args: argparse.Namespace) -> int:
    """generate under torchrun: this process is one stage of a --pp-size engine (runtime/pipeline/). It opens and
    checks only its own files, every rank states what it started with (a mismatch, or a rank that failed to start,
    stops all of them with one line), loads its own layers (rank 0 also the draft), and decodes; rank 0 prints (main
    silences the others' stdout)."""
    import hashlib

    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.kv_cache import MemoryPlanError
    from trtllm_dustin.models.errors import ModelLoadError
    from trtllm_dustin.plugins.kernel_config import KernelConfig
    from trtllm_dustin.plugins.kv_dtype import draft_kv_dtype
    from trtllm_dustin.runtime.build import attention_backend, runtime_kernels
    from trtllm_dustin.runtime.generation import GenerationConfig
    from trtllm_dustin.runtime.methods import METHODS
    from trtllm_dustin.runtime.pipeline import (
        PipelineDecoder,
        PipelineGroup,
        PipelineSetup,
        PipelineStage,
        pipeline_method,
    )
    from trtllm_dustin.runtime.sampling import SamplingParams

    if args.engine is None:
        raise ConfigError("a pipeline-parallel run (torchrun) reads its stages from an engine: build one with "
                          "`trtllm-dustin build --pp-size N --out DIR` and pass --engine DIR")
    pipeline_method(args.method)  # a method without a pipeline split is refused before the group starts
    if METHODS[args.method].needs_longspark:
        raise ConfigError(f"--method {args.method} under torchrun: an engine's shard gives rank 0 its own layers only, "
                          "and the LongSpark drafter there runs blocks of the target layers it reads; run it with "
                          "--pp-size 1, or from Python with PipelineSetup.longspark (runtime/pipeline/decoder.py)")
    if args.profile:
        raise ValueError("--profile times the phases of one process's round; a pipeline-parallel run has none, drop it")
    method = METHODS[args.method]
    with PipelineGroup.from_env(args.device or _default_device(), timeout_s=args.pp_timeout) as group:
        device, error = group.device, None
        try:  # a rank that cannot start says why in the handshake, so that every rank stops with its line
            engine = _open_engine(args, device, method, group.world, group.rank)
            target = _open("target", None, args.seed, engine)
            draft, dustin = _open_drafters(args, [args.method], target, engine)
            prompt = _prompt_ids(args, target)
            dtype = engine.manifest.limits.torch_dtype
            a, z = engine.layers
            models, kv_dtypes, shares = [("target", target)], [dtype], [(z - a) / target.config.num_layers]
            if draft is not None:
                models.append(("draft", draft))
                kv_dtypes.append(draft_kv_dtype(args.draft_kv_cache, dtype))
                shares.append(1.0 if group.first else 0.0)
            lookahead = args.gamma if method.speculative else 0
            max_seq_len = _check_limits(args, prompt, lookahead, models, kv_dtypes, device, dtype, shares,
                                        sparse_k=_sparse_k(args, method, dustin),
                                        engine_seq_len=engine.manifest.limits.max_seq_len)
        except (ValueError, ConfigError, ModelLoadError, MemoryPlanError) as e:
            engine, error = None, str(e)
        facts = {} if engine is None else {
            "engine manifest sha256": engine.sha256, "prompt": hashlib.sha256(str(prompt).encode()).hexdigest()[:16],
            "sampling": f"temperature {args.temperature} top-p {args.top_p} seed {args.seed}",
            "max_new_tokens": str(args.max_new_tokens), "backend": str(args.backend)}
        group.handshake(facts, error)

        start = time.perf_counter()
        stage = PipelineStage.load(target.config, a, z, group.rank, group.world, target.tensors(device),
                                   target.source, device, dtype)
        print(f"target: layers [{a}, {z}) of {target.config.num_layers} here (each of the {group.world} ranks loads "
              f"its own shard), loaded in {time.perf_counter() - start:.1f} s", flush=True)
        draft_model = _load("draft", draft, device, dtype).model if draft is not None and group.first else None
        if draft_model is not None:
            _draft_weights(draft_model, args.draft_weights)
        kernels = runtime_kernels(KernelConfig.from_env(), engine.tactics)  # the TRTLLM_DUSTIN_* switches, read once
        backend = attention_backend(device, kernels, args.backend)
        decoder = PipelineDecoder(PipelineSetup(
            args.method, stage, group, backend, args.batch_size, max_seq_len,
            draft_config=draft.config if draft is not None else None, draft=draft_model, gamma=args.gamma,
            draft_budget=args.draft_budget, dustin=dustin, micro_batches=args.micro_batches, kv_dtype=dtype,
            draft_kv_dtype=kv_dtypes[1] if draft is not None else None, use_cuda_graph=not args.no_cuda_graph,
            kernels=kernels, layers=tuple(engine.manifest.layers)))
        gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=target.config.eos_token_ids,
                                      sampling=SamplingParams(args.temperature, args.top_p, args.seed))
        result = decoder.generate([prompt] * args.batch_size, gen_config)
    print(f"pipeline: {group.world} stages (layers {engine.manifest.layers}), {args.micro_batches} micro-batch(es)")
    _print_result(args, result, target.tokenizer, f"the engine {args.engine}", device, dtype, len(prompt))
    return 0


def _triton_repo(args: argparse.Namespace) -> int:
    from trtllm_dustin.runtime.methods import METHODS
    from trtllm_dustin.serving import ServingConfig, write_model_repository

    def check_smallest_request() -> None:
        lookahead = args.gamma if any(METHODS[m].speculative for m in args.method) else 0
        smallest = 2 + lookahead  # one prompt token, one new token, a round's drafts
        if args.max_seq_len < smallest:
            raise InputError(f"--max-seq-len {args.max_seq_len} holds no request: the smallest (1 prompt token + 1 "
                             "new token" + (f" + gamma {lookahead} kept free for a round's drafts" if lookahead else "")
                             + f") takes {smallest}; raise it to >= {smallest}")

    check_drafter_options(args, args.method, METHODS)
    check_dustin_config_used(args, args.method, METHODS)
    if args.engine is None:
        args.gamma = DEFAULT_GAMMA if args.gamma is None else args.gamma
        check_smallest_request()  # the models, drafter, Dustin config, device and limits, as `generate` checks them
        args.model, args.draft, args.longspark, args.ring, dustin = _repository_models(args)
    else:  # checked now, not first when the server loads the model
        from trtllm_dustin.build_engines.engine import check_serves, open_engine

        dustin = None
        if args.budget is not None:
            raise ValueError(f"--budget {args.budget}: a served engine keeps the budget it was built with; rebuild it "
                             f"with `trtllm-dustin build --budget {args.budget} ...`, or drop --budget")
        opened = open_engine(args.engine, device=args.device, serving=True)
        check_serves(opened, args.method)
        limits = opened.manifest.limits
        for name, asked, limit in (("max-batch", args.max_batch, limits.max_batch),
                                   ("max-seq-len", args.max_seq_len, limits.max_seq_len),
                                   ("gamma", args.gamma or 0, limits.gamma)):
            if asked > limit:
                raise ValueError(f"--{name} {asked} exceeds the engine's {limit}; lower it or rebuild the engine with "
                                 f"--{name} {asked}")
        args.gamma = limits.gamma if args.gamma is None else args.gamma  # the engine's unless --gamma lowers it
        check_smallest_request()
    config = ServingConfig(
        engine=str(args.engine.resolve()) if args.engine is not None else None,
        model=args.model, draft=args.draft, longspark=args.longspark, ring=args.ring, methods=tuple(args.method),
        dustin=dustin, max_batch=args.max_batch,
        max_seq_len=args.max_seq_len, queue_size=args.queue_size, device=args.device, dtype=args.dtype,
        backend=args.backend, gamma=args.gamma, draft_budget=args.draft_budget, draft_kv_cache=args.draft_kv_cache,
        draft_weights=args.draft_weights, use_cuda_graph=not args.no_cuda_graph, decoupled=not args.no_decoupled,
        weights_seed=args.seed, chat_template=args.chat_template, prefill_chunk=args.prefill_chunk,
        prefill_budget=args.prefill_budget, prefix_cache_mib=args.prefix_cache_mib, prefix_block=args.prefix_block)
    model_dir = write_model_repository(args.out, config, args.name)
    print(f"wrote {model_dir} (methods {', '.join(config.methods)}; default {config.method}; "
          f"{'decoupled' if config.decoupled else 'non-decoupled'})")
    print(f"serve it: trtllm-dustin serve --repo {args.out.resolve()}  (docs/serving.md)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Start tritonserver (HTTP on 127.0.0.1 only) and the HTTP front before it, say where they listen, restart the
    server if it dies, until Ctrl-C / SIGTERM; then stop both (docs/serving.md)."""
    import shutil
    import signal
    import tempfile
    import threading

    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.serving import ServingConfig
    from trtllm_dustin.serving.front import Front, FrontConfig, FrontServer
    from trtllm_dustin.serving.guard import BodyLimits
    from trtllm_dustin.serving.launch import (
        DRAIN_MARGIN_S,
        ServerError,
        TritonServer,
        check_endpoints,
        prepare_pytriton_server,
    )
    from trtllm_dustin.serving.metrics import FrontMetrics
    from trtllm_dustin.serving.openai_api import served_models
    from trtllm_dustin.serving.supervisor import Supervisor

    configs = sorted(args.repo.glob("*/1/serving_config.json"))
    models = [p.parent.parent.name for p in configs]
    if not models:
        raise ValueError(f"--repo {args.repo} holds no model written by `trtllm-dustin triton-repo`; write one with "
                         f"`trtllm-dustin triton-repo --out {args.repo}`")
    broken = []
    for path in configs:  # read as the server's model reads it: a repository none of whose models can load is refused
        try:
            ServingConfig.load(path)
        except (ConfigError, OSError, UnicodeDecodeError) as e:
            broken.append(str(e) if isinstance(e, ConfigError) else f"serving config {path} cannot be read ({e}); "
                          "regenerate the repository with `trtllm-dustin triton-repo`")
    if len(broken) == len(configs):
        raise ConfigError(broken[0])
    check_endpoints(args.address, args.http_port, args.grpc_port)
    log = args.log or args.repo.resolve() / "serve.log"  # Triton loads the repository's directories only
    if args.log is None:
        check_output("--log", log, OUTPUTS["serve"]["log"])
    limits = BodyLimits(args.max_body_bytes, args.max_json_depth)
    if not (args.server_dir / "bin" / "tritonserver").is_file():
        print(f"preparing nvidia-pytriton's tritonserver in {args.server_dir} (once)", flush=True)
        prepare_pytriton_server(args.server_dir)
    metrics_dir = Path(tempfile.mkdtemp(prefix="trtllm-dustin-metrics-"))
    server = TritonServer(args.repo, args.server_dir, log, start_timeout_s=args.start_timeout, address=args.address,
                          http_address="127.0.0.1", http_port=0, grpc_port=args.grpc_port, keep_going=True,
                          exit_timeout_s=args.drain + DRAIN_MARGIN_S, metrics_dir=metrics_dir,
                          stop_timeout_s=max(60.0, args.drain + DRAIN_MARGIN_S + 30))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting tritonserver for {', '.join(models)} (log: {log})", flush=True)
    try:
        server.start()
    except ServerError as e:
        raise ValueError(str(e)) from None
    # A model that fails to load is reported, and the others are served; with none loaded there is nothing to serve.
    states = server.model_states()
    ready = [name for name, (state, _) in sorted(states.items()) if state == "READY"]
    for name, (state, reason) in sorted(states.items()):
        if state != "READY":
            reason = reason.split("\n\nAt:")[0].strip()  # the Python backend appends the traceback's frames
            print(f"trtllm-dustin: error: model {name} failed to load ({state}): {reason} (log: {log})",
                  file=sys.stderr, flush=True)
    if not ready:
        server.stop()
        if len(states) > 1:
            print(f"trtllm-dustin: error: no model of {args.repo} loaded; fix the errors above and start again",
                  file=sys.stderr)
        return 1
    metrics = FrontMetrics(metrics_dir)
    served = {name: model for name, model in served_models(args.repo).items() if name in ready}
    front = FrontServer(Front(FrontConfig(server.http_url, served, limits), metrics), args.address, args.http_port)
    front.start()
    host = "127.0.0.1" if args.address in ("0.0.0.0", "::") else args.address
    print(f"ready: {', '.join(ready)} on HTTP http://{host}:{front.port}, gRPC {server.grpc_url} (OpenAI API: "
          f"http://{host}:{front.port}/v1, metrics: /metrics, requests: docs/serving.md); Ctrl-C stops it", flush=True)
    supervised = Supervisor(server, metrics, metrics_dir).watch(stop)
    # The front stays up while the server drains, so that the running streams get their last event.
    print("stopping tritonserver (SIGTERM: the models unload, running requests end)", flush=True)
    try:
        server.stop()
    finally:
        front.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    print("stopped", flush=True)
    return 0 if supervised else 1


def _open_drafters(args: argparse.Namespace, methods: list[str], target: Checkpoint,
                   engine: OpenedEngine | None = None) -> tuple[Checkpoint | None, DustinConfig | None]:
    """What the methods need beside the target, opened and checked against it (no weight is read): the draft, the
    LongSpark and ring drafters' configs and the Dustin config, with the default model's packaged ones when none is
    named (an engine brings its own). Records the choice in args.draft / args.longspark / args.ring /
    args.dustin_config."""
    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.dustin_config import DustinConfig
    from trtllm_dustin.models.longspark import DEFAULT_LONGSPARK, LongSparkConfig, longspark_config
    from trtllm_dustin.models.packaged import DEFAULT_DRAFT, DEFAULT_MODEL, default_dustin_config_path
    from trtllm_dustin.models.ring_drafter import DEFAULT_RING, ring_config
    from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS

    default_model = args.model in (None, DEFAULT_MODEL) and engine is None
    check_drafter_options(args, methods, {m: METHODS[m] for m in OFFERED_METHODS})
    draft = None
    needing = [m for m in methods if METHODS[m].needs_draft]
    if needing:
        if args.draft is None and engine is None:
            if not default_model:
                raise ConfigError(f"methods {needing} need a draft model; pass --draft DIR|FILE.gguf|preset:NAME")
            args.draft = DEFAULT_DRAFT  # the packaged draft distilled for the default model
        draft = _open("draft", args.draft, args.seed + 1, engine)
    needing = [m for m in methods if METHODS[m].needs_longspark]
    if needing:
        spark = longspark_config(_drafter_spec(args, "longspark", needing, default_model, DEFAULT_LONGSPARK,
                                               "train-longspark"))
        if spark is not None:
            spark.check_target(target.config)
        block = (spark or LongSparkConfig(target_layers=(0,))).block  # "random": the default shape
        if args.gamma > block:
            raise InputError(f"--gamma {args.gamma} exceeds the {block} tokens this LongSpark drafter proposes per "
                             f"round (its block); lower --gamma to <= {block}")
        print(f"LongSpark drafter: {args.longspark}" + (" (random weights at the target's shape)" if spark is None
              else f" (reads target layers {list(spark.target_layers)}, window {spark.window}, block {spark.block})"),
              flush=True)
    needing = [m for m in methods if METHODS[m].needs_ring]
    if needing:
        ring = ring_config(_drafter_spec(args, "ring", needing, default_model, DEFAULT_RING, "train-ring-drafter"),
                           target.config)
        if args.gamma > ring.block:
            raise InputError(f"--gamma {args.gamma} exceeds the {ring.block} tokens this ring drafter proposes per "
                             f"round; lower --gamma to <= {ring.block}")
        print(f"ring drafter: {args.ring}" + (" (random weights at the target's shape)" if args.ring == "random"
              else "") + f" (reads target layers {list(ring.read_layers)}, {len(ring.own_layers)} own layers, window "
              f"{ring.window}, up to {ring.block} tokens per round)", flush=True)
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    if engine is not None:
        dustin, args.dustin_config = engine.dustin, engine.directory / "dustin.json"
    needing = [m for m in methods if METHODS[m].needs_dustin]
    if needing and dustin is None and default_model and args.draft in (None, DEFAULT_DRAFT):
        args.dustin_config = default_dustin_config_path()  # searched for the packaged pair
        dustin = DustinConfig.load(args.dustin_config)
    if needing and dustin is None:
        raise ConfigError(f"methods {needing} need --dustin-config FILE (SRH heads, budget, m); write one for this "
                          "target/draft pair with `trtllm-dustin search`")
    if dustin is not None:
        dustin.check_models(target.config, draft.config if draft is not None else None,
                            f"Dustin config {args.dustin_config}")
        if getattr(args, "budget", None) is not None:
            dustin = dustin.with_budget(args.budget)
        selection = ", ".join(f"{lh.layer} ({len(lh.heads)} heads)" for lh in dustin.selection_layers)
        window = f", score window {dustin.score_window} ({dustin.score_window_op})" if dustin.score_window > 1 else ""
        print(f"Dustin config: {args.dustin_config} (budget k {dustin.budget} cached positions per verification, "
              f"m {dustin.m} of them chosen by the draft's attention"
              + (f"; in-pass selection layers {selection}{window}" if selection else "") + "; fingerprints match)",
              flush=True)
    _baseline_budgets(args, methods, dustin)
    return draft, dustin


def _drafter_spec(args: argparse.Namespace, option: str, needing: list[str], default_model: bool, packaged: str,
                  trainer: str) -> str:
    """args.<option> (--longspark / --ring), set to the packaged drafter trained for the default model when it names
    none; with another model the methods `needing` it must be given one."""
    from trtllm_dustin.config import ConfigError

    if getattr(args, option) is None:
        if not default_model:
            raise ConfigError(f"methods {needing} need --{option} DIR (from `trtllm-dustin {trainer}`), or --{option} "
                              "random for random weights")
        setattr(args, option, packaged)
    return getattr(args, option)


def _baseline_budgets(args: argparse.Namespace, methods: list[str], dustin: DustinConfig | None) -> None:
    """The k of the sparse baselines (streamingllm, snapkv, quest): the Dustin config's when one is given, else
    --draft-budget, which --budget sets (unless MagicDec, whose draft window --draft-budget also is, is served too);
    said as Dustin's is. --budget with no sparse method is refused."""
    from trtllm_dustin.runtime.methods import METHODS

    budget = getattr(args, "budget", None)
    if budget is not None and not any(METHODS[m].sparse for m in methods):
        raise InputError(f"--budget {budget}: no method here ({', '.join(methods)}) verifies against a budget k; "
                         "drop --budget, or choose a sparse method (dustin-*, streamingllm, snapkv, quest)")
    baselines = [m for m in methods if METHODS[m].sparse and not METHODS[m].needs_dustin]
    if not baselines:
        return
    if dustin is None and budget is not None:
        if "magicdec" in methods:
            raise InputError(f"--budget {budget}: without a Dustin config the baselines' k is --draft-budget, which is "
                             "also MagicDec's draft window here; pass --draft-budget or a --dustin-config instead")
        RANGES["draft_budget"].check("budget", budget)  # it becomes their --draft-budget
        args.draft_budget = budget
    k, source = (dustin.budget, "the Dustin config's") if dustin is not None else \
        (args.draft_budget, "--budget" if budget is not None else "--draft-budget, without a Dustin config")
    if "snapkv" in baselines:
        from trtllm_dustin.runtime.selectors.snapkv import WINDOW

        if k <= WINDOW:
            raise InputError(f"snapkv: budget k {k} ({source}) must exceed SnapKV's observation window of {WINDOW} "
                             f"prompt tokens, which the set always keeps; raise it to > {WINDOW}")
    print(f"{', '.join(baselines)}: budget k {k} ({source})", flush=True)


def _repository_models(args: argparse.Namespace
                       ) -> tuple[str | None, str | None, str | None, str | None, DustinConfig | None]:
    """triton-repo without an engine: open every model it will serve (configs only) and check what `generate` checks
    (the models exist and open, the device, --max-seq-len against their positions, weights + the caches of every
    served method against free memory, the drafter and the Dustin config against the models), with the same
    defaults for the default model (its packaged draft, Dustin config, LongSpark and ring drafters). Returns the model,
    draft, LongSpark and ring specs with file paths made absolute (the server starts elsewhere) and the Dustin
    config."""
    import torch

    from trtllm_dustin.fetch import FETCHABLE
    from trtllm_dustin.kv_cache import KVCache, check_fits
    from trtllm_dustin.models.longspark import DEFAULT_LONGSPARK
    from trtllm_dustin.models.packaged import DEFAULT_DRAFT, DEFAULT_MODEL
    from trtllm_dustin.models.ring_drafter import DEFAULT_RING, ring_weight_bytes
    from trtllm_dustin.plugins.kv_dtype import draft_kv_dtype
    from trtllm_dustin.runtime.methods import METHODS

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible here; write the repository on the machine that "
                         "serves it, or use --device cpu")
    dtype = getattr(torch, _dtype_name(args.dtype, device.type))
    target = _open("target", args.model, args.seed)
    draft, dustin = _open_drafters(args, args.method, target)
    models = [("target", target, dtype, len(args.method))]
    if draft is not None:
        models.append(("draft", draft, draft_kv_dtype(args.draft_kv_cache, dtype),
                       sum(METHODS[m].needs_draft for m in args.method)))
    for role, checkpoint, _, _ in models:
        positions = checkpoint.config.max_position_embeddings
        if args.max_seq_len > positions:
            raise ValueError(f"--max-seq-len {args.max_seq_len} exceeds the {role}'s {positions} positions "
                             f"({checkpoint.config.name}); lower it")
    if args.budget is not None:
        check_budget(args.budget, args.max_seq_len)
    weights = sum(checkpoint.config.num_parameters() * dtype.itemsize for _, checkpoint, _, _ in models)
    if any(METHODS[m].needs_ring for m in args.method):  # one ring drafter, shared by the methods that draft with it
        weights += ring_weight_bytes(args.ring, target.config, dtype.itemsize)
    caches = sum(copies * KVCache.nbytes_for(checkpoint.config, args.max_batch, args.max_seq_len, kv)
                 for _, checkpoint, kv, copies in models)
    ks = [k for k in (_sparse_k(args, METHODS[m], dustin) for m in args.method) if k is not None]
    gather = _gather_bytes(target.config, args.max_batch, max(ks), args.gamma, dtype) if ks else 0
    prefixes = len(args.method) * args.prefix_cache_mib * 2**20
    check_fits(f"the repository's model (weights {weights / 2**30:.2f} GiB + KV caches of {len(args.method)} "
               f"method(s) x {args.max_batch} x {args.max_seq_len} tokens {caches / 2**30:.2f} GiB"
               + (f" + the sparse gather at k = {max(ks)} {gather / 2**30:.2f} GiB" if ks else "")
               + (f" + prefix caches {prefixes / 2**30:.2f} GiB" if prefixes else "") + ")",
               weights + caches + gather + prefixes, device,
               fix="lower --max-batch, --max-seq-len or --prefix-cache-mib, or serve fewer --method")

    def absolute(spec: str | None) -> str | None:
        named = (None, "random", DEFAULT_MODEL, DEFAULT_DRAFT, DEFAULT_LONGSPARK, DEFAULT_RING, *FETCHABLE)
        return spec if spec in named or spec.startswith("preset:") else str(Path(spec).expanduser().resolve())

    return absolute(args.model), absolute(args.draft), absolute(args.longspark), absolute(args.ring), dustin


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"] and os.environ.get("RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")  # a pipeline's other ranks are silent; their errors still show
    try:
        early = _early_generate_args(argv)
    except InputError as e:
        print(f"trtllm-dustin: error: {e}", file=sys.stderr)
        return 2
    if early is not None:
        print(_loading_line(early), flush=True)  # before the slow imports below
    from trtllm_dustin.config import ConfigError
    from trtllm_dustin.kv_cache import MemoryPlanError
    from trtllm_dustin.models.errors import ModelLoadError
    from trtllm_dustin.runtime.pipeline import PipelineError

    args = build_parser().parse_args(argv)
    try:
        check_options(args)  # every numeric option of every command, before anything is opened or loaded
        check_paths(args.command, args)  # every file read exists, every output can be written
        return args.func(args)
    except (ValueError, ConfigError, ModelLoadError, MemoryPlanError, PipelineError) as e:
        print(f"trtllm-dustin: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
