"""Bad input on the command line, as a new user types it: each is refused with one exact line that names the value,
the limit and the fix, and nothing is loaded first: the options alone are refused before generate's first line
(which comes before torch is imported), what needs a model's config once the configs are open and before any weight
is read or cache allocated. The validation layer's own invariants (every option has a range, the torch-free view of
the method registry) are checked here too; the bad HTTP requests are in test_serving_real_pair.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from trtllm_dustin.cli import build_parser, main
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.loading import Checkpoint
from trtllm_dustin.validation import RANGES, MethodFacts, method_facts

E = "trtllm-dustin: error: "
TINY = ["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "5"]
PAIR = [*TINY, "--draft", "preset:tiny-llama-draft"]
SPARSE = ("dustin-h, dustin-t, dustin-d, dustin-h-sparse-draft, streamingllm, snapkv, quest, dustin-ip, "
          "dustin-ip-pages, dustin-ip-sparse-draft, dustin-t-longspark, dustin-ip-longspark, dustin-ip-ring")
DRAFTING = ("classic, magicdec, dustin-h, dustin-t, dustin-d, dustin-h-sparse-draft, streamingllm, snapkv, quest, "
            "dustin-ip, dustin-ip-pages, dustin-ip-sparse-draft")
WEIGHTED = DRAFTING + ", ring, dustin-ip-ring"  # the methods --draft-weights rounds (a draft model's or ring drafter's)
KERNELS = "(a round verifies gamma + 1 tokens and the kernels take at most 16)"
DUSTIN_FIX = "write it with `trtllm-dustin search`"

# (argv, stderr): refused from the options alone, before anything is printed (generate: before its first line)
BEFORE_ANYTHING = [
    (["generate", "--method", "nosuch"], "trtllm-dustin generate: error: argument --method: invalid choice: 'nosuch' "
     "(choose from 'vanilla', 'classic', 'magicdec', 'dustin-h', 'dustin-t', 'dustin-d', 'dustin-h-sparse-draft', "
     "'streamingllm', 'snapkv', 'quest', 'dustin-ip', 'dustin-ip-pages', 'dustin-ip-sparse-draft', 'longspark', "
     "'dustin-t-longspark', 'dustin-ip-longspark', 'ring', 'dustin-ip-ring'); see `trtllm-dustin generate --help`"),
    (["generate", "--gamma", "x"], "trtllm-dustin generate: error: argument --gamma: invalid int value: 'x'; see "
     "`trtllm-dustin generate --help`"),
    (["generate", "--temperature", "nan"], E + "--temperature nan is not a finite number; pass a number >= 0 (0: "
     "greedy)"),
    (["generate", "--temperature", "inf"], E + "--temperature inf is not a finite number; pass a number >= 0 (0: "
     "greedy)"),
    (["generate", "--temperature", "-1"], E + "--temperature -1.0 must be >= 0 (0: greedy); raise it"),
    (["generate", "--top-p", "2"], E + "--top-p 2.0 must be in (0, 1] (the nucleus's probability mass; 1: no cut); "
     "lower it"),
    (["generate", "--top-p", "0"], E + "--top-p 0.0 must be in (0, 1] (the nucleus's probability mass; 1: no cut); "
     "raise it"),
    (["generate", "--top-p", "nan"], E + "--top-p nan is not a finite number; pass a number in (0, 1] (the "
     "nucleus's probability mass; 1: no cut)"),
    (["generate", "--gamma", "0"], E + f"--gamma 0 must be in 1..15 {KERNELS}; raise it"),
    (["generate", "--gamma", "100"], E + f"--gamma 100 must be in 1..15 {KERNELS}; lower it"),
    (["generate", "--gamma", "16"], E + f"--gamma 16 must be in 1..15 {KERNELS}; lower it"),
    (["generate", "--budget", "0"], E + "--budget 0: --method vanilla verifies against the whole cache and has no "
     f"budget k; drop --budget, or choose a sparse method ({SPARSE})"),
    (["generate", "--method", "classic", "--budget", "512"], E + "--budget 512: --method classic verifies against "
     f"the whole cache and has no budget k; drop --budget, or choose a sparse method ({SPARSE})"),
    (["generate", "--method", "dustin-h", "--budget", "-3"], E + "--budget -3 must be >= 1; raise it"),
    (["generate", "--draft-weights", "int8"], E + "--draft-weights int8: --method vanilla has no draft model or ring "
     "drafter, so it would change nothing; drop --draft-weights, or choose a method that drafts with one "
     f"({WEIGHTED})"),
    (["generate", "--method", "dustin-ip-ring", "--draft-kv-cache", "fp8"], E + "--draft-kv-cache fp8: --method "
     "dustin-ip-ring has no draft model, so it would change nothing; drop --draft-kv-cache, or choose a method that "
     f"drafts with one ({DRAFTING})"),
    (["generate", "--method", "longspark", "--draft-kv-cache", "fp8"], E + "--draft-kv-cache fp8: --method longspark "
     "has no draft model, so it would change nothing; drop --draft-kv-cache, or choose a method that drafts with one "
     f"({DRAFTING})"),
    (["generate", "--ring", "random"], E + "--ring random: --method vanilla drafts with no ring drafter, so it would "
     "change nothing; drop --ring, or choose a method that drafts with one (ring, dustin-ip-ring)"),
    (["generate", "--method", "ring", "--longspark", "random"], E + "--longspark random: --method ring drafts with no "
     "LongSpark drafter, so it would change nothing; drop --longspark, or choose a method that drafts with one "
     "(longspark, dustin-t-longspark, dustin-ip-longspark)"),
    (["generate", "--batch-size", "0"], E + "--batch-size 0 must be >= 1; raise it"),
    (["generate", "--max-new-tokens", "-5"], E + "--max-new-tokens -5 must be >= 1; raise it"),
    (["generate", "--max-seq-len", "0"], E + "--max-seq-len 0 must be >= 1; raise it"),
    (["generate", "--seed", "-1"], E + "--seed -1 must be in 0..9223372036854775806; raise it"),
    (["generate", "--seed", str(2**63)], E + "--seed 9223372036854775808 must be in 0..9223372036854775806; lower "
     "it"),
    (["generate", "--prompt-tokens", "0"], E + "--prompt-tokens 0 must be >= 1; raise it"),
    (["generate", "--draft-budget", "4"], E + "--draft-budget 4 must be >= 5 (the 4 attention sinks and at least one "
     "recent position); raise it"),
    (["generate", "--micro-batches", "0"], E + "--micro-batches 0 must be >= 1; raise it"),
    (["generate", "--pp-timeout", "nan"], E + "--pp-timeout nan is not a finite number; pass a number > 0"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], E + "--prompt-file /nonexistent/prompt.txt does not "
     "exist; pass a text file"),
    (["generate", "--dtype", "int8"], "trtllm-dustin generate: error: argument --dtype: invalid choice: 'int8' "
     "(choose from 'bfloat16', 'float16', 'float32'); see `trtllm-dustin generate --help`"),
    (["triton-repo", "--out", "{tmp}/repo", "--max-batch", "0"], E + "--max-batch 0 must be >= 1; raise it"),
    (["triton-repo", "--out", "{tmp}/repo", "--queue-size", "0"], E + "--queue-size 0 must be >= 1; raise it"),
    (["triton-repo", "--out", "{tmp}/repo", "--gamma", "20"], E + f"--gamma 20 must be in 1..15 {KERNELS}; lower it"),
    (["triton-repo"], "trtllm-dustin triton-repo: error: the following arguments are required: --out; see "
     "`trtllm-dustin triton-repo --help`"),
    (["serve", "--repo", "{tmp}/repo", "--http-port", "70000"], E + "--http-port 70000 must be in 0..65535 (0: any "
     "free port); lower it"),
    (["serve", "--repo", "{tmp}/repo", "--start-timeout", "0"], E + "--start-timeout 0.0 must be > 0; raise it"),
    (["serve", "--repo", "{tmp}/repo", "--drain", "-1"], E + "--drain -1.0 must be in [0, 3600] (seconds the running "
     "requests get to finish at stop); raise it"),
    (["build", "--out", "{tmp}/engine", "--max-seq-len", "0"], E + "--max-seq-len 0 must be >= 1; raise it"),
    (["build", "--out", "{tmp}/engine", "--budget", "512"], E + "--budget 512 sets the k of a Dustin config, and "
     "none is given; pass --dustin-config FILE, or drop --budget"),
    (["build", "--out", "{tmp}/engine", "--dustin-config", "{tmp}/small.json", "--budget", "5000"], E + "--budget "
     "5000 exceeds the KV cache's 4096 positions; a sparse verification reads at most that many: lower it to <= 4096 "
     "(a k that covers the whole context verifies in full)"),
    (["search", "--draft", "preset:tiny-llama-draft", "--out", "{tmp}/d.json", "--trials", "0"],
     E + "--trials 0 must be >= 1; raise it"),
    (["srh", "--out", "{tmp}/s.json", "--depths", "0.5", "1.5"], E + "--depths 1.5 must be in [0, 1]; lower it"),
    (["arr", "--out-dir", "{tmp}/arr", "--label", "x", "--kl-prompts", "-1"], E + "--kl-prompts -1 must be >= 0; "
     "raise it"),
    (["train-longspark", "--tokens", "{tmp}/t.npy", "--out", "{tmp}/spark", "--lr", "0"], E + "--lr 0.0 must be > 0; "
     "raise it"),
    (["train-draft", "--tokens", "{tmp}/t.npy", "--out", "{tmp}/draft", "--lr", "nan"], E + "--lr nan is not a "
     "finite number; pass a number > 0"),
    (["prepare-distill-data", "--out", "{tmp}/t.npy", "--seq-len", "0"], E + "--seq-len 0 must be >= 1; raise it"),
]

# (argv, stderr): refused once the configs are opened, before any weight is read
BEFORE_WEIGHTS = [
    (["generate", "--method", "snapkv", "--budget", "16"], E + "snapkv: budget k 16 (--budget) must exceed SnapKV's "
     "observation window of 32 prompt tokens, which the set always keeps; raise it to > 32"),
    (["generate", "--method", "dustin-h", "--budget", "99999999"], E + "--budget 99999999 exceeds the KV cache's "
     "1603 positions; a sparse verification reads at most that many: lower it to <= 1603 (a k that covers the whole "
     "context verifies in full)"),  # the default pair on its default prompt (1536 + 64 + gamma 3)
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/list.json"], E + "Dustin config {tmp}/list.json holds "
     f"a JSON list, not an object of fields; {DUSTIN_FIX}"),
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/budget.json"], E + "Dustin config {tmp}/budget.json: "
     f"field budget is \"big\" (a string); it must be an integer; {DUSTIN_FIX}"),
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/heads.json"], E + "Dustin config {tmp}/heads.json: "
     f"field target_layers[0].heads is 0 (a number); it must be a list; {DUSTIN_FIX}"),
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/typo.json"], E + "Dustin config {tmp}/typo.json: "
     "'bugdet' is not a field of DustinConfig (fields: target_layers, draft_layers, budget, m, n_sink, n_recent, "
     "gamma, target_fingerprint, draft_fingerprint, selection_layers, selection_m, dense_layers, pool_layers, "
     f"score_window, score_window_op); {DUSTIN_FIX}"),
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/cut.json"], E + "Dustin config {tmp}/cut.json is not "
     f"valid JSON (Expecting ',' delimiter: line 2 column 1 (char 21)); {DUSTIN_FIX}"),
    ([*PAIR, "--method", "dustin-h", "--dustin-config", "{tmp}/small.json"], E + "Dustin config {tmp}/small.json: "
     f"budget k=10 must exceed sinks + recent window = 20; {DUSTIN_FIX}"),
    ([*TINY, "--method", "longspark", "--longspark", "random", "--gamma", "8"], E + "--gamma 8 exceeds the 7 tokens "
     "this LongSpark drafter proposes per round (its block); lower --gamma to <= 7"),
    ([*TINY, "--method", "ring", "--ring", "random", "--gamma", "8"], E + "--gamma 8 exceeds the 7 tokens this ring "
     "drafter proposes per round; lower --gamma to <= 7"),
    ([*TINY, "--method", "ring"], E + "methods ['ring'] need --ring DIR (from `trtllm-dustin train-ring-drafter`), "
     "or --ring random for random weights"),
    ([*TINY, "--method", "ring", "--ring", "{tmp}"], E + "{tmp}: no ring drafter there (config.json missing); write "
     "one with `trtllm-dustin train-ring-drafter`"),
    ([*TINY, "--method", "ring", "--ring", "{tmp}/run"], E + "{tmp}/run is a training run's folder; its ring drafter "
     "is {tmp}/run/checkpoint: pass that"),
    ([*TINY, "--method", "longspark", "--longspark", "{tmp}/run"], E + "--longspark {tmp}/run is a training run's "
     "folder; its drafter is {tmp}/run/checkpoint: pass that"),
    ([*TINY, "--method", "ring", "--ring", "smollm2-ring"], E + "ring drafter layers [3, 9, 10, 15, 20, 22, 29] do "
     "not exist in tiny-llama (3 layers); train one for it with `trtllm-dustin train-ring-drafter`"),
    ([*TINY, "--max-seq-len", "5000"], E + "--max-seq-len 5000 exceeds the target's 2048 positions (tiny-llama); "
     "lower it"),
    ([*PAIR, "--method", "quest", "--max-new-tokens", "4", "--budget", "100"], E + "--budget 100 exceeds the KV "
     "cache's 12 positions; a sparse verification reads at most that many: lower it to <= 12 (a k that covers the "
     "whole context verifies in full)"),
    ([*PAIR, "--method", "streamingllm", "--budget", "3"], E + "--budget 3 must be >= 5 (the 4 attention sinks and "
     "at least one recent position); raise it"),  # without a Dustin config a baseline's k is its --draft-budget
    (["triton-repo", "--out", "{tmp}/repo", "--model", "preset:tiny-llama", "--max-seq-len", "64", "--budget", "32"],
     E + "--budget 32: no method here (vanilla) verifies against a budget k; drop --budget, or choose a sparse "
     "method (dustin-*, streamingllm, snapkv, quest)"),
    (["triton-repo", "--out", "{tmp}/repo", "--model", "preset:tiny-llama", "--draft", "preset:tiny-llama-draft",
      "--method", "quest", "--max-seq-len", "64", "--budget", "100"], E + "--budget 100 exceeds the KV cache's 64 "
     "positions; a sparse verification reads at most that many: lower it to <= 64 (a k that covers the whole context "
     "verifies in full)"),
]

CONFIGS = {  # the --dustin-config files of BEFORE_WEIGHTS, and a training run's folder (run/)
    "list.json": "[1, 2, 3]",
    "budget.json": {"schema_version": 1, "target_layers": [{"layer": 1, "heads": [0]}], "draft_layers": [],
                    "budget": "big"},
    "heads.json": {"schema_version": 1, "target_layers": [{"layer": 1, "heads": 0}], "draft_layers": []},
    "typo.json": {"schema_version": 1, "target_layers": [], "draft_layers": [], "bugdet": 3},
    "cut.json": '{"schema_version": 1\n',
    "small.json": {"schema_version": 1, "target_layers": [{"layer": 1, "heads": [0]}], "draft_layers": [],
                   "budget": 10},
    "run/checkpoint/config.json": "{}",
}


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a weight or allocating a KV cache fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read or a cache allocated before the input was refused")

    monkeypatch.setattr(Checkpoint, "load", refuse)
    monkeypatch.setattr(KVCache, "allocate", refuse)


def _refused(argv: list[str], tmp_path: Path, capsys) -> tuple[str, str]:
    """(stdout, stderr) of a command that must exit with status 2."""
    for name, content in CONFIGS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    try:
        code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, captured
    return captured.out, captured.err


@pytest.mark.parametrize("argv, message", BEFORE_ANYTHING, ids=[" ".join(a[:3]) for a, _ in BEFORE_ANYTHING])
def test_an_option_out_of_range_is_refused_before_anything(argv, message: str, tmp_path: Path, capsys,
                                                           nothing_loads) -> None:
    out, err = _refused(argv, tmp_path, capsys)
    assert err == message.replace("{tmp}", str(tmp_path)) + "\n"
    assert out == ""  # not even generate's first line ("loading ...")
    # no repository, engine or output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({name.split("/")[0] for name in CONFIGS})


@pytest.mark.parametrize("argv, message", BEFORE_WEIGHTS, ids=[" ".join(a[-2:]) for a, _ in BEFORE_WEIGHTS])
def test_a_limit_of_the_models_is_refused_before_any_weight(argv, message: str, tmp_path: Path, capsys,
                                                            nothing_loads) -> None:
    out, err = _refused(argv, tmp_path, capsys)
    assert err == message.replace("{tmp}", str(tmp_path)) + "\n"
    assert "weights loaded" not in out and "checked: KV caches" not in out
    assert not (tmp_path / "repo").exists()


def test_the_tables_are_the_size_the_issue_asks_for() -> None:
    assert len(BEFORE_ANYTHING) + len(BEFORE_WEIGHTS) >= 30


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand of `trtllm-dustin` and of `python -m trtllm_dustin.search.cli` (the docs use both)."""
    from trtllm_dustin.search.cli import build_parser as build_search_parser

    found = {}
    for prefix, parser in (("", build_parser()), ("search.cli ", build_search_parser())):
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        found.update({prefix + name: command for name, command in sub.choices.items()})
    return found


def test_every_numeric_option_has_a_range() -> None:
    """A new int or float option of any command must say its range in validation.RANGES, or it goes unchecked."""
    missing = sorted(f"{name} --{action.dest.replace('_', '-')}" for name, parser in _subcommands().items()
                     for action in parser._actions if action.type in (int, float) and action.dest not in RANGES)
    assert missing == []


def test_help_shows_every_default() -> None:
    """Each option's --help entry states its default: the value (a list's elements), or what None stands for."""
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.default == argparse.SUPPRESS or \
                    action.required:
                continue
            shown = " ".join(parser.formatter_class(parser.prog)._format_action(action).split())  # unwrapped
            value = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
            assert "default" in shown and (action.default is None or value in shown), (name, shown)


def test_the_streaming_sinks_are_the_runtimes() -> None:
    import inspect

    from trtllm_dustin.runtime.drafters.streaming_window import StreamingWindowView
    from trtllm_dustin.validation import STREAMING_SINKS

    assert inspect.signature(StreamingWindowView).parameters["n_sink"].default == STREAMING_SINKS


def test_the_registry_read_without_torch_is_the_registry() -> None:
    """The production registry (the experimental methods, added when runtime/experimental/ is imported, are no
    option of generate's)."""
    from helpers.registry import OFFERED

    from trtllm_dustin.runtime.methods import METHODS

    facts = method_facts()
    assert tuple(facts) == OFFERED and all(f.offered for f in facts.values())
    assert facts == {name: MethodFacts(METHODS[name].offered, METHODS[name].sparse, METHODS[name].needs_draft,
                                       METHODS[name].needs_ring, METHODS[name].needs_longspark) for name in OFFERED}


def test_the_draft_only_choices_read_without_torch_are_the_options() -> None:
    from trtllm_dustin.models.quantize import DRAFTER_WEIGHTS
    from trtllm_dustin.plugins.kv_dtype import DRAFT_KV_CHOICES
    from trtllm_dustin.validation import DRAFT_ONLY_CHOICES

    assert DRAFT_ONLY_CHOICES == {"draft-kv-cache": DRAFT_KV_CHOICES[1:], "draft-weights": DRAFTER_WEIGHTS[1:]}
    assert DRAFT_KV_CHOICES[0] == DRAFTER_WEIGHTS[0] == "model"


def test_gamma_stops_where_the_kernels_do() -> None:
    from trtllm_dustin.attention.triton import MAX_KERNEL_TOKENS
    from trtllm_dustin.plugins.checks import MAX_QUERY_TOKENS
    from trtllm_dustin.validation import MAX_GAMMA

    assert MAX_GAMMA + 1 == MAX_QUERY_TOKENS == MAX_KERNEL_TOKENS
