"""One validation layer for what users send: command-line options, config files and HTTP request fields.

The standard library only, so that `generate` refuses a bad option before torch is imported (about 3 s) and before
it prints what it loads. Every message is one line naming the value, the limit and the fix, in the terms of whoever
sent it: `--top-p 2.0` on the command line, `top_p=2.0` in a request (`Terms`).

    check_options(args)          every numeric option of every subcommand, against RANGES (finite, in range)
    check_request_length(...)    a request's prompt + max_tokens (+ gamma) against the cache, in its terms
    check_budget(...)            a sparse method's k against the cache it reads
    sparse_gather_bytes(...)     the memory a sparse verification gathers at k (the CPU path's)
    read_json_object(...)        a config file: valid JSON, an object, its fields those of the dataclass it fills
    load_versioned(...)          a versioned config file (read_versioned, check_fields) as its dataclass;
                                 versioned_json writes one
    method_facts()               the method registry's names and kinds, read without importing it (torch)

The checks that need a model's config (positions, memory) run after the configs are opened and before any weight
is read; the CLI and the serving engine call them with the numbers they have.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import re
import types
import typing
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trtllm_dustin.errors import ConfigError

__all__ = ["CLI", "DRAFT_ONLY_CHOICES", "HTTP", "MAX_GAMMA", "MAX_SEED", "RANGES", "STREAMING_SINKS", "InputError",
           "MethodFacts", "Range", "Terms", "check_budget", "check_device", "check_drafter_options",
           "check_dustin_config_used", "check_fields", "check_generate_options", "check_options", "check_prompt",
           "check_request_length", "check_value", "load_versioned", "method_facts", "read_json_object",
           "read_versioned", "sparse_gather_bytes", "versioned_json"]

T = TypeVar("T")

MAX_VERIFY_TOKENS = 16  # query tokens per sequence the decode kernels take (plugins/checks.py MAX_QUERY_TOKENS)
MAX_GAMMA = MAX_VERIFY_TOKENS - 1  # a round verifies gamma + 1 tokens: the last committed one and gamma drafts
MAX_SEED = 2**63 - 2  # the first token is sampled with seed + 1, which must fit an int64 generator seed
# The attention sinks of a StreamingLLM set: MagicDec's draft window and the baselines' k without a Dustin config
# (runtime/drafters/streaming_window.py, runtime/methods.py _budget) keep them and at least one recent position.
STREAMING_SINKS = 4


class InputError(ValueError):
    """An option or request field out of range; the message names the value, the limit and the fix."""


@dataclass(frozen=True)
class Terms:
    """How a message names a field and what the sender does about it: options on the command line, fields in a
    request."""

    cli: bool

    def name(self, field: str) -> str:
        return f"--{field.replace('_', '-')}" if self.cli else field

    def shown(self, field: str, value: Any) -> str:
        return f"{self.name(field)} {value}" if self.cli else f"{field}={value}"

    @property
    def verb(self) -> str:
        return "pass" if self.cli else "send"


CLI, HTTP = Terms(cli=True), Terms(cli=False)


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: [low, high], `open_low` excluding low; integers unless `real`."""

    low: float | None = None
    high: float | None = None
    real: bool = False
    open_low: bool = False
    why: str = ""  # what the limit is, for the message

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            if not self.real:
                return f"in {self.low}..{self.high}"
            return f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}]"
        if self.low is not None:
            return f"{'>' if self.open_low else '>='} {_number(self.low)}"
        return f"<= {_number(self.high)}"

    def check(self, field: str, value: Any, terms: Terms = CLI) -> None:
        shown = terms.shown(field, value)
        why = f" ({self.why})" if self.why else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (not self.real and
                                                                              isinstance(value, float)):
            kind = "a number" if self.real else "an integer"
            raise InputError(f"{shown} is not {kind}; {terms.verb} {kind} {self.text()}{why}")
        if not math.isfinite(value):
            raise InputError(f"{shown} is not a finite number; {terms.verb} a number {self.text()}{why}")
        low = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        high = self.high is not None and value > self.high
        if low or high:
            fix = ("raise it" if low else "lower it") if terms.cli else \
                f"send a {'larger' if low else 'smaller'} value"
            raise InputError(f"{shown} must be {self.text()}{why}; {fix}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_POSITIVE = Range(1)
_COUNT = Range(0)
_SHARE = Range(0, 1, real=True)
_SECONDS = Range(0, real=True, open_low=True)
_PORT = Range(0, 65535, why="0: any free port")
_SEED = Range(0, MAX_SEED)
# Prompt tokens prefilled per scheduler step by default. On the H200 with the real pair (64 clients, 4K prompts,
# benchmarks/results/serving_h200_batched/) 16K, 64K and 128K all cut time to first token p99 6-10x against one chunk
# per step and raise output tokens/s 1.6-1.9x; the round of the running requests waits for the step's prefill, whose
# time grows with the budget and the target's size, so the default is the smallest of them.
DEFAULT_PREFILL_BUDGET = 16384
# Every numeric option of every subcommand (the argparse dest, the same name as a request field where both exist),
# checked by check_options after parsing and before anything loads. tests/test_bad_input.py checks that no int or
# float option of the parser is missing here.
RANGES: dict[str, Range] = {
    # generate, build, triton-repo
    "batch_size": _POSITIVE, "max_new_tokens": _POSITIVE, "max_seq_len": _POSITIVE,
    "max_tokens": Range(1, 2**31 - 1, why="an INT32: Triton wraps a JSON number past 2147483647 around"),
    "prompt_tokens": _POSITIVE, "max_batch": _POSITIVE, "queue_size": _POSITIVE, "pp_size": _POSITIVE,
    "first_stage_layers": _POSITIVE, "micro_batches": _POSITIVE, "pp_timeout": _SECONDS,
    "prefill_chunk": _POSITIVE, "prefill_budget": Range(0, why="0: one chunk per step"), "prefix_block": _POSITIVE,
    "prefix_cache_mib": Range(0, why="0: no prefix caching"),
    "temperature": Range(0, real=True, why="0: greedy"),
    "top_p": Range(0, 1, real=True, open_low=True, why="the nucleus's probability mass; 1: no cut"),
    "seed": _SEED, "random_seed": _SEED,
    "gamma": Range(1, MAX_GAMMA, why=f"a round verifies gamma + 1 tokens and the kernels take at most "
                                     f"{MAX_VERIFY_TOKENS}"),
    "draft_budget": Range(STREAMING_SINKS + 1, why=f"the {STREAMING_SINKS} attention sinks and at least one recent "
                                                   "position"),
    "budget": _POSITIVE,
    # serve
    "http_port": _PORT, "grpc_port": _PORT, "start_timeout": _SECONDS,
    "drain": Range(0, 3600, real=True, why="seconds the running requests get to finish at stop"),
    "max_body_bytes": Range(1024, 2**30, why="bytes of an HTTP body the front reads"),
    "max_json_depth": Range(4, 10_000, why="JSON nesting of an HTTP body (an OpenAI chat request nests 4 deep)"),
    # prepare-distill-data, regenerate-data, train-draft, train-longspark, train-ring-drafter
    "seq_len": _POSITIVE, "max_windows": _POSITIVE, "context": _POSITIVE, "new": _POSITIVE,
    "position_decay": Range(0, 1, real=True, open_low=True, why="draft slot g's loss weight is this ** g; 1: alike"),
    "steps": _POSITIVE, "lr": Range(0, real=True, open_low=True),
    "head_vocab": _COUNT, "max_seconds": _SECONDS, "stop_after": _SECONDS, "window": _POSITIVE, "summary": _POSITIVE,
    "block": _POSITIVE,
    "lora_rank": _POSITIVE, "fuse_rank": _POSITIVE, "markov_rank": _POSITIVE, "anchor_stride": _POSITIVE,
    "anchor_from": _POSITIVE, "causal_stride": _POSITIVE,
    # srh, arr, search
    "lengths": _POSITIVE, "depths": _SHARE, "needles": Range(3, why="the test needs three distinct needles"),
    "min_recall": _SHARE, "heads_per_layer": _POSITIVE, "batch": _POSITIVE, "documents": _POSITIVE,
    "max_delta": _POSITIVE, "n_sink": _COUNT, "n_recent": _COUNT, "budgets": _POSITIVE, "deltas": _POSITIVE,
    "m": _COUNT, "kl_prompts": _COUNT, "kl_prompt_len": _POSITIVE, "kl_new_tokens": _POSITIVE, "kl_budget": _POSITIVE,
    "search_budgets": _POSITIVE, "phase2_share": _SHARE, "max_draft_layers": _POSITIVE, "trials": _POSITIVE,
    # search-layers
    "needle_windows": _COUNT, "lag": _POSITIVE, "max_layers": _POSITIVE, "min_gain": Range(0, real=True),
    "max_pool": _COUNT,
}


def check_value(field: str, value: Any, terms: Terms = CLI) -> None:
    """One field against its RANGES entry (a list: each element)."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        RANGES[field].check(field, item, terms)


def check_options(args: Namespace | Mapping[str, Any], terms: Terms = CLI) -> None:
    """Every field of `args` that RANGES knows and that was given (None: the default, decided later), and a
    --device."""
    values = vars(args) if isinstance(args, Namespace) else args
    for field, value in values.items():
        if field in RANGES and value is not None:
            check_value(field, value, terms)
    if terms.cli and isinstance(values.get("device"), str):
        check_device(values["device"])


_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_device(value: str, option: str = "--device") -> None:
    """A device this build runs on: cpu, cuda or cuda:N (torch would raise with its list of every device type)."""
    if not _DEVICE.fullmatch(value):
        raise InputError(f"{option} {value}: this build runs on cpu or cuda (cuda:N for GPU N); pass one of them")


# generate's options that only a draft model reads -> their values other than "model" (plugins/kv_dtype.py
# DRAFT_KV_CHOICES and models/quantize.py DRAFTER_WEIGHTS import torch; tests/test_bad_input.py checks they agree);
# --draft-weights also rounds a ring drafter's weights (RING_TOO)
DRAFT_ONLY_CHOICES = {"draft-kv-cache": ("fp8",), "draft-weights": ("int8",)}
RING_TOO = ("draft-weights",)
# options naming a drafter of their own methods only -> (the MethodFacts flag of those methods, what the drafter is)
DRAFTER_OPTIONS = {"draft": ("needs_draft", "draft model"), "longspark": ("needs_longspark", "LongSpark drafter"),
                   "ring": ("needs_ring", "ring drafter")}


def check_generate_options(args: Namespace, facts: dict[str, MethodFacts] | None) -> None:
    """`generate`'s options on their own, before any model is opened: what the method takes, the prompt file, then
    every range. facts: method_facts() (None: the method-specific checks wait for the registry)."""
    from trtllm_dustin.paths import check_paths  # it imports this module

    check_paths("generate", args)  # a path that is missing or of the wrong kind first: nothing else can be said of it
    method = facts.get(args.method) if facts else None
    if method is not None and args.budget is not None and not method.sparse:
        sparse = ", ".join(name for name, f in facts.items() if f.offered and f.sparse)
        raise InputError(f"--budget {args.budget}: --method {args.method} verifies against the whole cache and has "
                         f"no budget k; drop --budget, or choose a sparse method ({sparse})")
    if method is not None and not method.needs_draft:
        for option, choices in DRAFT_ONLY_CHOICES.items():
            ring = option in RING_TOO
            if ring and method.needs_ring:
                continue
            value = getattr(args, option.replace("-", "_"))
            if value in choices:  # another value: the full parser's choices refuse it
                drafting = ", ".join(name for name, f in facts.items()
                                     if f.offered and (f.needs_draft or (ring and f.needs_ring)))
                what = "draft model or ring drafter" if ring else "draft model"
                raise InputError(f"--{option} {value}: --method {args.method} has no {what}, so it would change "
                                 f"nothing; drop --{option}, or choose a method that drafts with one ({drafting})")
    if facts is not None:
        check_drafter_options(args, [args.method], facts)
        check_dustin_config_used(args, [args.method], facts)
    check_options(args)
    check_prompt(args)


def check_prompt(args: Namespace) -> None:
    """A --prompt or --prompt-file with text in it (an empty one would answer an empty chat turn)."""
    if args.prompt is not None and not args.prompt.strip():
        raise InputError(f"--prompt {args.prompt!r} is empty; pass some text, or drop --prompt for the default prompt")
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text()
        except UnicodeDecodeError as e:
            raise InputError(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                             f"offset {e.start}); pass a text file") from None
        except OSError as e:
            raise InputError(f"--prompt-file {args.prompt_file} cannot be read ({e.strerror}); pass a text file "
                             "you can read") from None
        if not text.strip():
            raise InputError(f"--prompt-file {args.prompt_file} is empty; write the prompt into it, or pass --prompt "
                             "TEXT")


def check_drafter_options(args: Namespace, methods: Sequence[str], facts: Mapping[str, Any]) -> None:
    """--draft / --longspark / --ring name a drafter that only their own methods read: given with none of those among
    `methods` (facts: name -> MethodFacts or the registry's Method), it would change nothing, and is refused."""
    for option, (flag, what) in DRAFTER_OPTIONS.items():
        value = getattr(args, option, None)
        if value is not None and not any(getattr(facts[m], flag) for m in methods):
            using = ", ".join(name for name, f in facts.items() if f.offered and getattr(f, flag))
            chosen = f"--method {methods[0]}" if len(methods) == 1 else f"methods {', '.join(methods)}"
            raise InputError(f"--{option} {value}: {chosen} drafts with no {what}, so it would change nothing; drop "
                             f"--{option}, or choose a method that drafts with one ({using})")


def check_dustin_config_used(args: Namespace, methods: Sequence[str], facts: Mapping[str, Any]) -> None:
    """--dustin-config is read by the sparse methods only (its heads, or its k for the baselines): given with none of
    them it would change nothing, and is refused."""
    if getattr(args, "dustin_config", None) is not None and not any(facts[m].sparse for m in methods):
        sparse = ", ".join(name for name, f in facts.items() if f.offered and f.sparse)
        chosen = f"--method {methods[0]}" if len(methods) == 1 else f"methods {', '.join(methods)}"
        raise InputError(f"--dustin-config {args.dustin_config}: {chosen} verifies against the whole cache and reads "
                         f"no Dustin config, so it would change nothing; drop it, or choose a sparse method ({sparse})")


def check_request_length(field: str, prompt_tokens: int, max_tokens: int, lookahead: int, max_seq_len: int) -> None:
    """A request's cache positions, in its own terms: its prompt (`field`: text_input or input_ids), the tokens it
    asks for and the `lookahead` positions a speculative round writes past them (gamma) must fit the model's
    `max_seq_len` positions (the repository's limit, which the client cannot change)."""
    if prompt_tokens < 1:
        raise InputError(f"{field} is empty; send at least one token")
    reserved = f", {lookahead} of them kept free for a round's draft tokens" if lookahead else ""
    room = max_seq_len - prompt_tokens - lookahead
    if room < 1:
        raise InputError(f"{field} is {prompt_tokens} tokens long, and this model holds {max_seq_len} positions per "
                         f"request{reserved}; send a prompt of at most {max_seq_len - lookahead - 1} tokens")
    if max_tokens > room:
        raise InputError(f"max_tokens={max_tokens} does not fit: this model holds {max_seq_len} positions per "
                         f"request{reserved}, and {field} takes {prompt_tokens}; send max_tokens <= {room}")


def check_budget(budget: int, max_seq_len: int, terms: Terms = CLI) -> None:
    """A sparse method's budget k against the cache it selects from: k positions beyond the cache do not exist."""
    if budget > max_seq_len:
        raise InputError(f"{terms.shown('budget', budget)} exceeds the KV cache's {max_seq_len} positions; a sparse "
                         f"verification reads at most that many: lower it to <= {max_seq_len} (a k that covers the "
                         "whole context verifies in full)")


def sparse_gather_bytes(batch: int, budget: int, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        itemsize: int) -> int:
    """The largest transient of one layer's sparse verification on the CPU path (the reference gathers the k
    selected keys and values of every sequence, [B, H_kv, k + T, D] each, and SDPA scores them in fp32,
    [B, H_q, T, k + T]); the GPU's kernel reads the set in place."""
    rows = batch * (budget + tokens)
    return rows * (2 * num_kv_heads * head_dim * itemsize + num_kv_heads * 8 + 3 * num_heads * tokens * 4)


# ---- config files -----------------------------------------------------------------------------------------------
def read_json_object(text: str, source: str, fix: str) -> dict[str, Any]:
    """The JSON object a config file holds; ConfigError naming the file (`source`) and `fix` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} holds a JSON {_json_kind(data)}, not an object of fields; {fix}")
    return data


def versioned_json(version: int, fields: Mapping[str, Any], indent: int = 2) -> str:
    """A config's fields as the JSON object its reader takes: `schema_version` first, then the fields."""
    return json.dumps({"schema_version": version, **fields}, indent=indent)


def read_versioned(text: str, versions: tuple[int, ...], source: str, fix: str,
                   version_fix: str | None = None) -> dict[str, Any]:
    """The fields of a versioned config file (`schema_version` taken out), refusing a version not in `versions`;
    ConfigError naming the file (`source`) and `fix` (`version_fix` for another version, if given) otherwise."""
    data = read_json_object(text, source, fix)
    version = data.pop("schema_version", None)
    if version not in versions:
        expected = versions[0] if len(versions) == 1 else f"one of {versions}"
        raise ConfigError(f"{source}: schema_version {version} is not {expected}; {version_fix or fix}")
    return data


def load_versioned(cls: type[T], text: str, versions: tuple[int, ...], source: str, fix: str,
                   version_fix: str | None = None) -> T:
    """The dataclass `cls` a versioned config file holds, its fields checked (check_fields) before `cls` checks
    their values; every ConfigError names the file (`source`) and `fix`."""
    data = read_versioned(text, versions, source, fix, version_fix)
    check_fields(data, cls, source, fix)
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}; {fix}") from None


def check_fields(data: dict[str, Any], cls: type, source: str, fix: str, where: str = "") -> None:
    """`data`'s keys are fields of the dataclass `cls`, every field without a default is there, and each value has
    the field's type (int, float, str, bool, None, tuples/lists of them, nested dataclasses, recursively)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: {where}{unknown[0]!r} is not a field of {cls.__name__} (fields: "
                          f"{', '.join(fields)}); {fix}")
    missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{source}: field {where}{missing[0]} is missing; {fix}")
    for name, value in data.items():
        _check_type(value, hints[name], source, fix, f"{where}{name}")


def _check_type(value: Any, hint: Any, source: str, fix: str, where: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                _check_type(value, option, source, fix, where)
                return
            except ConfigError:
                continue
        raise ConfigError(f"{source}: field {where} is {_json_value(value)}; it must be "
                          f"{' or '.join(_kind(a) for a in args)}; {fix}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: field {where} is {_json_value(value)}; it must be an object "
                              f"({hint.__name__}); {fix}")
        check_fields(value, hint, source, fix, f"{where}.")
        return
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: field {where} is {_json_value(value)}; it must be a list; {fix}")
        item = args[0] if args else Any
        for i, element in enumerate(value):
            _check_type(element, item, source, fix, f"{where}[{i}]")
        return
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: field {where} is {_json_value(value)}; it must be an object; {fix}")
        return
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
          type(None): lambda v: v is None}.get(hint, lambda v: True)
    if not ok(value):
        raise ConfigError(f"{source}: field {where} is {_json_value(value)}; it must be {_kind(hint)}; {fix}")


def _kind(hint: Any) -> str:
    if dataclasses.is_dataclass(hint):
        return f"an object ({hint.__name__})"
    if typing.get_origin(hint) in (tuple, list):
        return "a list"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}.get(
        hint, str(hint))


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null", dict: "object"}.get(
        type(value), "number")


def _json_value(value: Any) -> str:
    text = json.dumps(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} (a {_json_kind(value)})"


# ---- the method registry, torch-free ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodFacts:
    """What the option checks need to know of a registered method."""

    offered: bool  # a user option (not evaluation only)
    sparse: bool  # verifies against a budget of k positions (takes --budget)
    needs_draft: bool = True  # drafts with a draft model (takes --draft-kv-cache, --draft-weights)
    needs_ring: bool = False  # drafts with a ring drafter (takes --ring, --draft-weights)
    needs_longspark: bool = False  # drafts with a LongSpark drafter (takes --longspark)


def method_facts() -> dict[str, MethodFacts] | None:
    """The registry of runtime/methods.py (METHODS), read from its source without importing it: importing it
    imports torch, and `generate` refuses an unknown --method before that. None when the registry's source cannot
    be read this way (then the full parser refuses it, after the import and still before any weight is read);
    tests/test_bad_input.py checks that this equals the imported registry."""
    spec = importlib.util.find_spec("trtllm_dustin.runtime")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "methods.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    defaults: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Method":  # the flags' defaults
            defaults = {field.target.id: field.value.value for field in node.body if isinstance(field, ast.AnnAssign)
                        and isinstance(field.target, ast.Name) and isinstance(field.value, ast.Constant)}
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "METHODS" and isinstance(node.value, ast.Dict):
            return _facts(node.value, defaults)
    return None


_FLAGS = ("offered", "sparse", "needs_draft", "needs_ring", "needs_longspark")


def _facts(registry: ast.Dict, defaults: dict[str, Any]) -> dict[str, MethodFacts] | None:
    """name -> MethodFacts of the METHODS literal, each Method(...)'s flags given as constants or defaulted."""
    if any(not isinstance(defaults.get(flag), bool) for flag in _FLAGS):
        return None
    facts = {}
    for key, value in zip(registry.keys, registry.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Call)):
            return None
        flags = dict(defaults)
        for keyword in value.keywords:
            if keyword.arg in _FLAGS:
                if not isinstance(keyword.value, ast.Constant) or not isinstance(keyword.value.value, bool):
                    return None
                flags[keyword.arg] = keyword.value.value
        facts[key.value] = MethodFacts(**{flag: flags[flag] for flag in _FLAGS})
    return facts
