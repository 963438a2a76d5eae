"""The command line end to end on a random-weight preset, its first line, and EOS / max-token stops."""

from __future__ import annotations

import re
import subprocess
import sys
from itertools import pairwise

import pytest
import torch
from helpers.models import vanilla_decoder

from trtllm_dustin.attention import get_backend
from trtllm_dustin.cli import _early_generate_args, main
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.generation import GenerationConfig, GenerationResult
from trtllm_dustin.runtime.methods import MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams


def test_generate_prints_tokens_and_timings(capsys) -> None:
    code = main(["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "9", "--batch-size", "2",
                 "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("[0] [") == 1 and out.count("[1] [") == 1
    assert "generated 12 tokens" in out and "prefill" in out and "tokens/s" in out
    lines = out.splitlines()
    assert lines[0] == "trtllm-dustin generate: loading preset:tiny-llama (random weights) onto cpu (float32)"
    assert lines[1].startswith("target: tiny-llama, ") and "random weights (seed 0)" in lines[1]
    assert lines[2].startswith("checked: KV caches 2 x 15 tokens")
    assert lines[3].startswith("target: weights loaded in")


def test_the_first_line_needs_no_torch() -> None:
    """What `generate` prints first is worked out before torch, triton and transformers are imported (~3 s)."""
    code = ("import sys; from trtllm_dustin.cli import _early_generate_args, _loading_line; "
            "print(_loading_line(_early_generate_args(['generate', '--device', 'cpu']))); "
            "print(sorted(m for m in ('torch', 'triton', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("trtllm-dustin generate: loading SmolLM2-135M-Instruct (the default model)")
    assert out[0].endswith("onto cpu (float32)") and out[1] == "[]"


@pytest.mark.parametrize("argv, expected", [
    (["generate"], (None, None, None)),
    (["generate", "--model=preset:tiny-qwen", "--max-new-tokens", "3", "--dtype", "bfloat16"],
     ("preset:tiny-qwen", None, "bfloat16")),
    (["generate", "--prompt", "hi", "--device", "cuda:1"], (None, "cuda:1", None)),
    (["generate", "--dev", "cuda"], (None, "cuda", None)),  # an abbreviation, read as the full parser reads it
    (["generate", "--help"], None), (["srh", "--model", "x"], None)])
def test_early_arguments(argv: list[str], expected: tuple | None) -> None:
    args = _early_generate_args(argv)
    assert (args if args is None else (args.model, args.device, args.dtype)) == expected


def test_a_bad_value_is_refused_before_the_first_line(capsys) -> None:
    """argparse's refusal, in one line, before anything is printed or imported (tests/test_bad_input.py has the
    rest)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--dtype", "int8"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "trtllm-dustin generate: error: argument --dtype: invalid choice: 'int8' (choose from 'bfloat16', 'float16', "
        "'float32'); see `trtllm-dustin generate --help`\n")


def test_eos_stops_a_sequence_and_others_continue() -> None:
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=1).model
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    cache = KVCache.allocate(model.config, 2, 64, torch.float64, "cpu")
    free_run = vanilla_decoder(model, cache).generate(
        prompts, GenerationConfig(max_new_tokens=12)).tokens
    eos = free_run[0][4]  # make the 5th token of sequence 0 an end-of-sequence token
    stopped = vanilla_decoder(model, cache).generate(
        prompts, GenerationConfig(max_new_tokens=12, eos_token_ids=(eos,), sync_every=3)).tokens
    first = free_run[0].index(eos)
    assert stopped[0] == free_run[0][: first + 1]
    if eos in free_run[1]:
        assert stopped[1] == free_run[1][: free_run[1].index(eos) + 1]
    else:
        assert stopped[1] == free_run[1]


def assert_rate_over_decoding_rounds(result: GenerationResult, decoding_rounds: int) -> None:
    """The reference: the per-round timestamps, the last decoding round's end, the tokens after each first."""
    assert result.decoding_rounds == decoding_rounds <= result.rounds == len(result.round_ms)
    assert all(a < b for a, b in pairwise(result.round_ms))
    assert result.decoding_ms == result.round_ms[decoding_rounds - 1] <= result.round_ms[-1] <= result.decode_ms
    decoded = sum(len(t) - 1 for t in result.tokens)
    assert result.decode_tokens_per_s == pytest.approx(decoded / (result.round_ms[decoding_rounds - 1] / 1e3))


def test_the_cpu_runs_no_idle_round(plugin_references) -> None:
    """Sequences that end early (EOS, the token limit): on the CPU the loop reads the finished flag after every round
    (a host read there, no device sync) and stops right after the last decoding round; the rate is over those."""
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=1).model
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    cache = KVCache.allocate(model.config, 2, 64, torch.float64, "cpu")
    free_run = vanilla_decoder(model, cache).generate(prompts, GenerationConfig(max_new_tokens=20)).tokens
    eos = (free_run[0][4], free_run[1][6])
    result = vanilla_decoder(model, cache).generate(
        prompts, GenerationConfig(max_new_tokens=20, eos_token_ids=eos, sync_every=16))
    longest = max(len(t) for t in result.tokens)
    assert longest <= 7 and result.rounds == longest - 1  # vanilla: a token a round, the first from the prefill
    assert_rate_over_decoding_rounds(result, result.rounds)
    limited = vanilla_decoder(model, cache).generate(prompts, GenerationConfig(max_new_tokens=6))
    assert limited.rounds == 5 and all(len(t) == 6 for t in limited.tokens)  # no 6th round with nothing to do
    assert_rate_over_decoding_rounds(limited, 5)


def test_speculative_decoding_rounds_end_with_the_sequence(plugin_references) -> None:
    target = load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=torch.float64, seed=8).model
    caches = [KVCache.allocate(m.config, 1, 64, torch.float64, "cpu") for m in (target, draft)]
    decoder = build_decoder("classic", MethodSetup(target=target, target_cache=caches[0], draft=draft,
                                                   draft_cache=caches[1], backend=get_backend("reference"), gamma=3))
    result = decoder.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=12))
    assert len(result.tokens[0]) == 12
    assert_rate_over_decoding_rounds(result, sum(result.committed_hist))  # one sequence: a hist entry per round


def test_sampled_generation_is_reproducible_with_a_seed() -> None:
    model = load_model("preset:tiny-qwen", seed=2).model
    cache = KVCache.allocate(model.config, 2, 40, torch.float32, "cpu")
    decoder = vanilla_decoder(model, cache)
    config = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(1.0, 0.95, seed=11))
    a = decoder.generate([[1, 2, 3], [4, 5]], config).tokens
    b = decoder.generate([[1, 2, 3], [4, 5]], config).tokens
    assert a == b and all(len(t) == 16 for t in a)


def test_classic_with_no_model_arguments_runs_the_packaged_pair_on_a_long_text(capsys) -> None:
    code = main(["generate", "--method", "classic", "--max-new-tokens", "12", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "prompt: the first 1536 tokens of" in out and "validation split" in out
    assert "prompt 1536 tokens, generated" in out
    tau = float(out.split("mean accepted length tau ")[1].split()[0].rstrip(","))
    assert 1.0 <= tau <= 4.0  # Γ = 3: between 1 and Γ + 1 tokens per round


def test_budget_runs_dustin_at_another_k_with_m_scaled(capsys, tmp_path, plugin_references) -> None:
    """--budget K: the config's k replaced, m carried over as the same share of the free slots (k - 20); a k that
    leaves no free slot is refused before any weight is read."""
    from trtllm_dustin.dustin_config import DustinConfig, LayerHeads

    config = tmp_path / "dustin.json"
    DustinConfig(target_layers=(LayerHeads(1, (0, 4)),), draft_layers=(LayerHeads(1, (2, 3)),), budget=60,
                 m=20).save(config)
    run = ["generate", "--model", "preset:tiny-llama", "--draft", "preset:tiny-llama-draft", "--method", "dustin-h",
           "--dustin-config", str(config), "--prompt-tokens", "50", "--max-new-tokens", "4", "--max-seq-len", "128"]
    assert main(run + ["--budget", "100"]) == 0
    assert "(budget k 100 cached positions per verification, m 40 of them chosen by the draft's attention;" in \
        capsys.readouterr().out  # 20 of 40 free slots -> 40 of 80
    assert main(run + ["--budget", "20"]) == 2
    captured = capsys.readouterr()
    assert "--budget 20 must exceed sinks + recent window = 20; raise it" in captured.err
    assert "weights loaded" not in captured.out


def test_a_score_window_is_said_beside_the_selection_layer(capsys, tmp_path, plugin_references) -> None:
    """An in-pass config with a score window: generate says the window beside the selection layer and runs; with k over
    the whole context the set keeps every position, so the window has nothing to choose and the greedy tokens equal
    vanilla's."""
    from trtllm_dustin.dustin_config import DustinConfig, LayerHeads

    config = tmp_path / "dustin.json"
    DustinConfig(target_layers=(LayerHeads(1, (0, 4)),), draft_layers=(LayerHeads(1, (2, 3)),), budget=60, m=20,
                 selection_layers=(LayerHeads(1, (0, 4)),), score_window=7, score_window_op="max").save(config)
    run = ["generate", "--model", "preset:tiny-llama", "--prompt-tokens", "90", "--max-new-tokens", "6",
           "--max-seq-len", "128"]
    pair = [*run, "--draft", "preset:tiny-llama-draft"]
    assert main([*pair, "--method", "dustin-ip", "--dustin-config", str(config)]) == 0
    assert "in-pass selection layers 1 (2 heads), score window 7 (max);" in capsys.readouterr().out
    texts = {}
    for name, argv in (("vanilla", [*run, "--method", "vanilla"]),  # no draft: vanilla would refuse one
                       ("full-k", [*pair, "--method", "dustin-ip", "--dustin-config", str(config), "--budget", "120"])):
        assert main(argv) == 0
        out = capsys.readouterr().out
        texts[name] = [line for line in out.splitlines() if line.startswith("[0] ")]
    assert texts["full-k"] == texts["vanilla"] and texts["vanilla"]


@pytest.mark.parametrize("method, extra, line", [
    ("quest", [], "quest: budget k 512 (--draft-budget, without a Dustin config)"),
    ("snapkv", ["--budget", "40"], "snapkv: budget k 40 (--budget)"),
    ("streamingllm", ["--draft-budget", "24"], "streamingllm: budget k 24 (--draft-budget, without a Dustin config)"),
])
def test_the_baselines_say_their_budget(capsys, plugin_references, method: str, extra: list[str], line: str) -> None:
    """As Dustin's config line does: the k each sparse baseline verifies with, and where it came from."""
    assert main(["generate", "--model", "preset:tiny-llama", "--draft", "preset:tiny-llama-draft", "--method", method,
                 "--prompt-tokens", "40", "--max-new-tokens", "4", *extra]) == 0
    assert line in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("command, required", [("generate", []), ("build", ["--out", "e"]),
                                               ("triton-repo", ["--out", "r"])])
def test_draft_weights_is_offered_beside_the_draft_kv_cache(capsys, command: str, required: list[str]) -> None:
    """--draft-weights {model,int8} wherever --draft-kv-cache is: model by default (--help says so), int8 taken,
    anything else refused by the parser, before a model is opened, with the accepted values."""
    from trtllm_dustin.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command, *required]).draft_weights == "model"
    assert parser.parse_args([command, *required, "--draft-weights", "int8"]).draft_weights == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    usage = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(capsys.readouterr().out.split()))  # argparse wraps its lines
    assert "--draft-kv-cache {model,fp8}" in usage and "--draft-weights {model,int8}" in usage
    assert re.search(r"--draft-weights \{model,int8\} the draft model's layers \(and the ring drafter's layers and "
                     r"head\): model \(its dtype\) or int8 \(weight-only, one scale per output row: half the bytes a "
                     r"draft step reads; tau within about 1 % on the real pair\)[^(]* \(default: model\)", usage)
    with pytest.raises(SystemExit) as exit_:
        main([command, *required, "--draft-weights", "int4"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "weights loaded" not in captured.out and f"trtllm-dustin {command}: error: argument --draft-weights: " \
        "invalid choice: 'int4' (choose from 'model', 'int8')" in captured.err


def test_the_ring_methods_run_the_packaged_ring_drafter_and_commit_the_targets_tokens(capsys) -> None:
    """generate --method ring / dustin-ip-ring with no model argument: the default model, its packaged ring drafter
    (said, with its shape) and, for dustin-ip-ring, the packaged Dustin config's selection layer. Full verification
    with the ring drafter commits vanilla's greedy tokens, as loaded and with --draft-weights int8; both accept some
    proposals and reject others."""
    common = ["generate", "--max-new-tokens", "24", "--device", "cpu", "--prompt", "Name three colours of the sky."]
    texts, outs = {}, {}
    for name, extra in (("vanilla", ["--method", "vanilla"]), ("ring", ["--method", "ring"]),
                        ("ring-int8", ["--method", "ring", "--draft-weights", "int8", "--gamma", "7"]),
                        ("dustin-ip-ring", ["--method", "dustin-ip-ring", "--gamma", "5"])):
        assert main([*common, *extra]) == 0
        outs[name] = capsys.readouterr().out
        lines = outs[name].splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("[0] "))
        last = next(i for i, line in enumerate(lines) if line.startswith("model "))
        texts[name] = lines[first:last]  # the generated text, before the run's summary
    assert "ring drafter: smollm2-ring (reads target layers [3, 9, 15, 22, 29], 4 own layers, window 256, up to 7 " \
        "tokens per round)" in outs["ring"]
    assert "in-pass selection layers 21" in outs["dustin-ip-ring"]
    assert texts["ring"] == texts["ring-int8"] == texts["vanilla"]
    for name in ("ring", "ring-int8", "dustin-ip-ring"):
        tau = float(outs[name].split("mean accepted length tau ")[1].split(",")[0])
        assert 1.0 < tau < {"ring": 4.0, "ring-int8": 8.0, "dustin-ip-ring": 6.0}[name], name


def test_the_memory_check_counts_the_ring_drafter(capsys, monkeypatch, plugin_references) -> None:
    """generate's check of weights + caches against free memory counts a ring drafter's own weights: the ring method
    needs exactly ring_weight_bytes more than LongSpark (no draft model, the same target cache) on the same run."""
    from trtllm_dustin import kv_cache
    from trtllm_dustin.config import ModelConfig
    from trtllm_dustin.models.presets import get_preset
    from trtllm_dustin.models.ring_drafter import ring_weight_bytes

    needed = {}
    real = kv_cache.check_fits
    for method in ("longspark", "ring"):
        def record(what, need, device, method=method, **kwargs):
            if what.startswith("this run"):  # generate's own check (the cache allocations check again)
                needed[method] = need
            return real(what, need, device, **kwargs)

        monkeypatch.setattr(kv_cache, "check_fits", record)
        assert main(["generate", "--model", "preset:tiny-llama", "--method", method, f"--{method}", "random",
                     "--prompt-tokens", "20", "--max-new-tokens", "6"]) == 0
    capsys.readouterr()
    config: ModelConfig = get_preset("tiny-llama")
    assert needed["ring"] - needed["longspark"] == ring_weight_bytes("random", config, 4) > 0


def test_int8_draft_weights_change_proposals_never_tokens(capsys, tmp_path, monkeypatch, plugin_references) -> None:
    """generate --draft-weights int8: the draft runs with its layers' projections in weight-only int8 (what reaches
    the runtime, held on to here), and greedy speculative decoding commits exactly the tokens it commits with the
    draft as loaded. The draft is the target with noise in its layers, so that both accept some proposals."""
    from trtllm_dustin.models.loading import save_hf_checkpoint
    from trtllm_dustin.models.quantize import Int8Linear
    from trtllm_dustin.runtime import build

    noisy = load_model("preset:tiny-llama", seed=0).model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in noisy.named_parameters():
            if name.startswith("layers.") and weight.dim() == 2:
                weight.add_(torch.randn(weight.shape, generator=gen) * 0.3 * weight.std())
    save_hf_checkpoint(noisy, tmp_path / "draft")
    drafts = []

    def build_runtime(method, target, **kwargs):
        drafts.append(kwargs["draft"])
        return real(method, target, **kwargs)

    real = build.build_runtime
    monkeypatch.setattr(build, "build_runtime", build_runtime)
    runs = {}
    for weights in ("model", "int8"):
        assert main(["generate", "--model", "preset:tiny-llama", "--draft", str(tmp_path / "draft"), "--method",
                     "classic", "--prompt-tokens", "20", "--max-new-tokens", "40", "--batch-size", "2",
                     "--draft-weights", weights]) == 0
        out = capsys.readouterr().out
        runs[weights] = [line for line in out.splitlines() if line.startswith("[")]
        tau = float(out.split("mean accepted length tau ")[1].split(",")[0])
        assert 1.0 < tau < 4.0  # proposals accepted and rejected alike
        assert ("draft: 12 projections of its 3 layers in weight-only int8" in out) == (weights == "int8")
    assert len(runs["int8"]) == 2 and runs["int8"] == runs["model"]
    loaded, rounded = drafts
    assert not any(isinstance(m, Int8Linear) for m in loaded.modules())
    pairs = [(a, b) for a, b in zip(loaded.layers.modules(), rounded.layers.modules(), strict=True)
             if isinstance(a, torch.nn.Linear)]
    assert len(pairs) == 4 * len(rounded.layers) and all(isinstance(b, Int8Linear) for _, b in pairs)
    for linear, int8 in pairs:  # the weights they were rounded from, to within half a step of each row
        error = (int8.dequantized() - linear.weight).abs()
        assert (error <= int8.scale[:, None] / 2 * (1 + 1e-5)).all() and error.max() > 0
    assert torch.equal(rounded.embed.weight, loaded.embed.weight)
