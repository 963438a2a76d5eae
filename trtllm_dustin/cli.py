"""Command line: `trtllm-dustin generate` (with no arguments: SmolLM2-135M-Instruct, the embedded default)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from trtllm_dustin.attention import get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache, MemoryPlanError
from trtllm_dustin.models import LoadedModel, ModelLoadError, load_model
from trtllm_dustin.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL, default_dustin_config_path
from trtllm_dustin.models.longspark import DEFAULT_LONGSPARK, load_longspark
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES, draft_kv_dtype
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS, MethodSetup, build_decoder
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.search.cli import (
    add_arr_arguments,
    add_search_arguments,
    add_srh_arguments,
    arr_command,
    search_command,
    srh_command,
)

__all__ = ["build_parser", "main"]

DEFAULT_PROMPT = "Write three sentences about why lighthouses were important to sailors."
DEFAULT_LONG_TOKENS = 1536  # speculative methods' default prompt: this much of a packaged book
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _method_list() -> str:
    return "; ".join(f"{name}: {METHODS[name].about}" for name in OFFERED_METHODS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-dustin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (vanilla or speculative decoding)")
    gen.add_argument("--model", default=None,
                     help="Hugging Face checkpoint directory, .gguf file, or preset:NAME (default: SmolLM2-135M)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text (default: a short instruction; for speculative "
                        "methods the opening of a validation-split book from the installed corpora)")
    prompt.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from this file")
    prompt.add_argument("--prompt-tokens", type=int, default=None,
                        help="random prompt of this many token ids (for presets, which have no tokenizer)")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    gen.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (the prompt repeated)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: prompt + new tokens)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                     help="weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)")
    gen.add_argument("--backend", choices=["reference", "triton"], default=None,
                     help="attention backend (default: triton on cuda, reference on cpu)")
    gen.add_argument("--no-cuda-graph", action="store_true", help="run decode steps eagerly on cuda")
    gen.add_argument("--method", choices=OFFERED_METHODS, default="vanilla", metavar="METHOD",
                     help="decoding method (default: vanilla): " + _method_list())
    gen.add_argument("--draft", default=None, help="draft model for speculative methods (same forms as --model; "
                     "default with the default model: its packaged distilled draft)")
    gen.add_argument("--longspark", default=None, help="LongSpark drafter for the longspark methods: a directory "
                     "from `train-longspark`, or random (random weights, for presets) (default with the default "
                     f"model: the packaged {DEFAULT_LONGSPARK})")
    gen.add_argument("--gamma", type=int, default=3, help="draft tokens per speculative round (default: 3)")
    gen.add_argument("--draft-budget", type=int, default=512, help="MagicDec: the draft's StreamingLLM KV budget")
    gen.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model",
                     help="the draft's KV cache dtype: the model's, or fp8 (e4m3, half the draft's cache reads; "
                          "only the acceptance rate can change, the target's cache stays in --dtype)")
    gen.add_argument("--dustin-config", type=Path, default=None,
                     help="Dustin estimator config (JSON written by `trtllm-dustin search`; default for the default "
                     "pair: the packaged one)")
    gen.add_argument("--profile", action="store_true", help="time each phase of a round with device events")
    gen.set_defaults(func=_generate)

    repo = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository (docs/serving.md)")
    repo.add_argument("--out", type=Path, required=True, help="repository directory (created; other models kept)")
    repo.add_argument("--name", default="dustin", help="model name inside the repository")
    repo.add_argument("--model", default=None,
                      help="Hugging Face checkpoint directory, .gguf file, or preset:NAME (default: SmolLM2-135M)")
    repo.add_argument("--draft", default=None, help="draft model for speculative methods (same forms as --model)")
    repo.add_argument("--method", nargs="+", choices=OFFERED_METHODS, default=["vanilla"], metavar="METHOD",
                      help="methods served, each with its own KV caches; the first is the default of a request "
                      "(default: vanilla); one or more of " + ", ".join(OFFERED_METHODS))
    repo.add_argument("--dustin-config", type=Path, default=None,
                      help="Dustin estimator config (JSON written by `trtllm-dustin search`), copied into the repo")
    repo.add_argument("--max-batch", type=int, default=8, help="batch slots per method (in-flight batching)")
    repo.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length: prompt + max_tokens (+ gamma)")
    repo.add_argument("--queue-size", type=int, default=64, help="requests waiting for a slot before refusing more")
    repo.add_argument("--device", default="cpu", help="cpu or cuda")
    repo.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                      help="weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)")
    repo.add_argument("--backend", choices=["reference", "triton"], default=None,
                      help="attention backend (default: triton on cuda, reference on cpu)")
    repo.add_argument("--longspark", default=None, help="LongSpark drafter for the longspark methods: a directory, "
                      f"or random (default with the default model: the packaged {DEFAULT_LONGSPARK})")
    repo.add_argument("--gamma", type=int, default=3, help="draft tokens per speculative round")
    repo.add_argument("--draft-budget", type=int, default=512, help="MagicDec: the draft's StreamingLLM KV budget")
    repo.add_argument("--draft-kv-cache", choices=DRAFT_KV_CHOICES, default="model",
                      help="the draft's KV cache dtype: the model's, or fp8 (e4m3, half the draft's cache reads)")
    repo.add_argument("--no-cuda-graph", action="store_true", help="run decode phases eagerly on cuda")
    repo.add_argument("--no-decoupled", action="store_true",
                      help="plain request/response model (HTTP infer; no streaming, batches per execute call)")
    repo.add_argument("--chat-template", action="store_true", help="wrap text_input in the tokenizer's chat template")
    repo.add_argument("--seed", type=int, default=0, help="weights seed of random presets (the draft's is seed + 1)")
    repo.set_defaults(func=_triton_repo)

    for name, add_arguments, command, text in (
            ("srh", add_srh_arguments, srh_command, "identify semantic retrieval heads (needle-in-a-haystack)"),
            ("arr", add_arr_arguments, arr_command, "ARR analysis: policies vs budget, layer-wise, ARR-KL"),
            ("search", add_search_arguments, search_command, "Algorithm 1: write a target-draft pair's Dustin config")):
        command_parser = sub.add_parser(name, help=text)
        add_arguments(command_parser)
        command_parser.set_defaults(func=command)

    prep = sub.add_parser("prepare-distill-data", help="tokenise train-split windows for draft distillation")
    prep.add_argument("--out", type=Path, required=True, help="output .npy (uint16 [windows, seq_len])")
    prep.add_argument("--seq-len", type=int, default=2048)
    prep.add_argument("--max-windows", type=int, default=None)
    prep.set_defaults(func=_prepare_distill_data)

    train = sub.add_parser("train-draft", help="distil a draft from the target (GPU recommended)")
    train.add_argument("--tokens", type=Path, required=True, help="file from prepare-distill-data")
    train.add_argument("--out", type=Path, required=True, help="directory for checkpoint/, record and loss curve")
    train.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    for name, default in (("steps", 2000), ("seq-len", 2048), ("batch-size", 8), ("seed", 0)):
        train.add_argument(f"--{name}", type=int, default=default)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--init-layers", default="0,10,20,29",
                       help="target blocks the draft starts from, comma-separated (empty: from scratch, --draft-shape)")
    train.add_argument("--head-vocab", type=int, default=16384,
                       help="output rows of a layer-subset draft: the most frequent train ids (0: whole vocabulary)")
    train.add_argument("--draft-shape", default="smollm2-draft-random", help="preset shape of a from-scratch draft")
    train.add_argument("--device", default=None)
    train.add_argument("--max-seconds", type=float, default=None, help="stop (and save) after this much training")
    train.set_defaults(func=_train_draft)

    from trtllm_dustin.training.longspark import LongSparkTrainConfig

    defaults = LongSparkTrainConfig()
    spark = sub.add_parser("train-longspark", help="train a LongSpark drafter against its frozen target (GPU; "
                           "resumable: rerun with the same --out)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    spark.add_argument("--tokens", type=Path, required=True, help="file from prepare-distill-data (train split)")
    spark.add_argument("--out", type=Path, required=True,
                       help="directory for checkpoint/, resume.pt, the training record and the loss curve")
    spark.add_argument("--target", default=None, help="target model; None: SmolLM2-135M-Instruct")
    spark.add_argument("--target-layers", default=",".join(map(str, defaults.target_layers)),
                       help="target layers read, one drafter block each")
    for name, text in (("window", "recent target KV rows per layer and head (W)"),
                       ("summary", "summary entries per layer and KV head (R)"),
                       ("block", "draft slots per block: the most tokens a round can propose"),
                       ("lora_rank", "rank of each block's adapters"), ("seq_len", "tokens per training window"),
                       ("batch_size", "windows per step"), ("anchor_stride", "positions between anchors"),
                       ("steps", "optimiser steps (a --max-seconds budget usually ends the run first)"),
                       ("seed", "initialisation, data order and anchors")):
        spark.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name), help=text)
    spark.add_argument("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate (cosine decay)")
    spark.add_argument("--device", default=None, help="cuda or cpu; None: cuda when available")
    spark.add_argument("--max-seconds", type=float, default=None, help="stop (and save) after this much training")
    spark.set_defaults(func=_train_longspark)
    return parser


def _prepare_distill_data(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.distill import prepare_tokens

    tokenizer = load_model(None).tokenizer
    summary = prepare_tokens(tokenizer, args.out, args.seq_len, max_windows=args.max_windows)
    print(json.dumps(summary, indent=2))
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.distill import DistillConfig, train_draft

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers = tuple(int(i) for i in args.init_layers.split(",") if i.strip())
    cfg = DistillConfig(seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                        seed=args.seed, warmup=min(100, args.steps // 10), init_layers=layers,
                        head_vocab=args.head_vocab if layers else 0, draft_shape=args.draft_shape)
    record = train_draft(args.tokens, args.out, cfg, target_spec=args.target, device=device,
                         max_seconds=args.max_seconds)
    print(json.dumps(record, indent=2))
    return 0


def _train_longspark(args: argparse.Namespace) -> int:
    from trtllm_dustin.training.longspark import LongSparkTrainConfig, train_longspark

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tokens.is_file():
        raise ConfigError(f"--tokens {args.tokens} does not exist; write it with `trtllm-dustin prepare-distill-data "
                          f"--out {args.tokens} --seq-len {args.seq_len}`")
    layers = tuple(int(i) for i in args.target_layers.split(",") if i.strip())
    cfg = LongSparkTrainConfig(target_layers=layers, window=args.window, summary=args.summary, block=args.block,
                               lora_rank=args.lora_rank, seq_len=args.seq_len, batch_size=args.batch_size,
                               anchor_stride=args.anchor_stride, steps=args.steps, lr=args.lr, seed=args.seed,
                               warmup=min(100, args.steps // 10))
    cfg.drafter("")  # the drafter's own checks, before the target loads
    record = train_longspark(args.tokens, args.out, cfg, target_spec=args.target, device=device,
                             max_seconds=args.max_seconds)
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


def _prompt_ids(args: argparse.Namespace, loaded: LoadedModel) -> list[int]:
    vocab = loaded.model.config.vocab_size
    if args.prompt_tokens is not None:
        if args.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens {args.prompt_tokens} must be >= 1")
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise ValueError(f"--prompt-file {args.prompt_file} does not exist")
        text = args.prompt_file.read_text()
    elif args.prompt is None and METHODS[args.method].speculative and loaded.tokenizer is not None:
        long_text = _long_text_prompt(loaded.tokenizer)
        if long_text is not None:
            return long_text
        text = DEFAULT_PROMPT
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"{loaded.source} has no tokenizer; pass --prompt-tokens N instead of a text prompt")
    if not args.raw and getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
    return tok.encode(text)


def _generate(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    loaded = load_model(args.model, device=device, dtype=dtype, seed=args.seed)
    config = loaded.model.config
    prompt = _prompt_ids(args, loaded)
    max_seq_len = args.max_seq_len or len(prompt) + args.max_new_tokens
    if max_seq_len > loaded.model.max_positions:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's {loaded.model.max_positions} positions; "
                         "lower it")
    method = METHODS[args.method]
    speculative = method.speculative
    if speculative:
        max_seq_len = max(max_seq_len, len(prompt) + args.max_new_tokens + args.gamma)
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else None
    default_pair = args.model in (None, DEFAULT_MODEL) and args.draft in (None, DEFAULT_DRAFT)
    if method.needs_dustin and dustin is None and default_pair:
        dustin = DustinConfig.load(default_dustin_config_path())  # searched for the packaged pair
    if method.needs_dustin and dustin is None:
        raise ConfigError(f"--method {args.method} needs --dustin-config FILE (SRH heads, budget, m); write one for "
                          "this target/draft pair with `trtllm-dustin search`")
    default_model = args.model in (None, DEFAULT_MODEL)
    if method.needs_longspark and args.longspark is None:
        if not default_model:
            raise ConfigError(f"--method {args.method} needs --longspark DIR (from `trtllm-dustin train-longspark`), "
                              "or --longspark random for random weights")
        args.longspark = DEFAULT_LONGSPARK  # the packaged drafter trained for the default model
    longspark = load_longspark(args.longspark, loaded.model, seed=args.seed + 1) if method.needs_longspark else None
    if method.needs_draft and args.draft is None:
        if not default_model:
            raise ConfigError(f"--method {args.method} needs --draft DIR|FILE.gguf|preset:NAME")
        args.draft = DEFAULT_DRAFT  # the packaged draft distilled for the default model
    draft = load_model(args.draft, device=device, dtype=dtype, seed=args.seed + 1,
                       share_with=loaded.model).model if method.needs_draft else None
    kernels = KernelConfig.from_env()  # the TRTLLM_DUSTIN_* switches, read once
    backend = get_backend(args.backend or ("triton" if device.type == "cuda" else "reference"), kernels)
    decoder = build_decoder(args.method, MethodSetup(
        target=loaded.model, target_cache=KVCache.allocate(config, args.batch_size, max_seq_len, dtype, device),
        backend=backend, draft=draft,
        draft_cache=KVCache.allocate(draft.config, args.batch_size, max_seq_len,
                                     draft_kv_dtype(args.draft_kv_cache, dtype), device)
        if draft else None,
        gamma=args.gamma, draft_budget=args.draft_budget, dustin=dustin, longspark=longspark,
        use_cuda_graph=not args.no_cuda_graph, kernels=kernels))
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=config.eos_token_ids,
                                  sampling=SamplingParams(args.temperature, args.top_p, args.seed))
    prompts = [prompt] * args.batch_size
    result = decoder.generate(prompts, gen_config, profile=args.profile)
    for i, ids in enumerate(result.tokens):
        text = loaded.tokenizer.decode(ids, skip_special_tokens=True) if loaded.tokenizer else str(ids)
        print(f"[{i}] {text}")
    print(f"model {loaded.source} on {device} ({str(dtype).removeprefix('torch.')}), batch {args.batch_size}, "
          f"prompt {len(prompt)} tokens, generated {result.generated} tokens")
    print(f"prefill {result.prefill_ms:.1f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s "
          f"({result.rounds} {'rounds' if speculative else 'steps'} in {result.decode_ms:.1f} ms)")
    if speculative:
        print(f"{args.method}: gamma {args.gamma}, mean accepted length tau {result.tau:.2f}, "
              f"tokens committed per round (1..{args.gamma + 1}): {result.committed_hist}")
    if result.phase_ms:
        print("phases (ms, whole run): " + ", ".join(f"{k} {v:.1f}" for k, v in result.phase_ms.items()))
    return 0


def _triton_repo(args: argparse.Namespace) -> int:
    from trtllm_dustin.serving import ServingConfig, write_model_repository

    config = ServingConfig(
        model=args.model, draft=args.draft, longspark=args.longspark, methods=tuple(args.method),
        dustin=DustinConfig.load(args.dustin_config) if args.dustin_config else None, max_batch=args.max_batch,
        max_seq_len=args.max_seq_len, queue_size=args.queue_size, device=args.device, dtype=args.dtype,
        backend=args.backend, gamma=args.gamma, draft_budget=args.draft_budget, draft_kv_cache=args.draft_kv_cache,
        use_cuda_graph=not args.no_cuda_graph, decoupled=not args.no_decoupled, weights_seed=args.seed,
        chat_template=args.chat_template)
    model_dir = write_model_repository(args.out, config, args.name)
    print(f"wrote {model_dir} (methods {', '.join(config.methods)}; default {config.method}; "
          f"{'decoupled' if config.decoupled else 'non-decoupled'})")
    print(f"serve it: tritonserver --model-repository {args.out.resolve()}  (docs/serving.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ConfigError, ModelLoadError, MemoryPlanError) as e:
        print(f"trtllm-dustin: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
