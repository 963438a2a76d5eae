"""What the serving tests share: the served configuration and the runtime's direct answer to compare with."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from helpers.kernels import use_interpreter
from trtllm_dustin.attention import get_backend
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import random_longspark
from trtllm_dustin.models.ring_drafter import RingDrafterConfig, load_ring_drafter, random_ring_drafter
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.inflight import InflightBatcher, SlotRequest
from trtllm_dustin.runtime.methods import METHODS, MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.serving import ServingConfig
from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine

WEIGHTS_SEED = 7
MAX_SEQ_LEN = 96
EOS = (1,)  # tiny-llama's
DUSTIN = DustinConfig(target_layers=(LayerHeads(1, (0, 4)),), draft_layers=(LayerHeads(0, (1,)), LayerHeads(1, (2, 3))),
                      budget=40, m=6, n_sink=4, n_recent=8, gamma=3,
                      selection_layers=(LayerHeads(1, tuple(range(6))),))  # sparse: 40 of up to 96 positions (SnapKV's
# window of 32 must fit in k)
SERVED = ServingConfig(model="preset:tiny-llama", draft="preset:tiny-llama-draft", longspark="random", ring="random",
                       methods=("classic", "vanilla", "dustin-h"), dustin=DUSTIN, max_batch=4,
                       max_seq_len=MAX_SEQ_LEN, queue_size=32, weights_seed=WEIGHTS_SEED, prefill_chunk=16)


def prompt_text(index: int, length: int) -> str:
    """A prompt for tokenizer-less presets: each character is a token id (chr(id)), ids in [2, 257)."""
    g = torch.Generator().manual_seed(1000 + index)
    return "".join(chr(i) for i in torch.randint(2, 257, (length,), generator=g).tolist())


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Run the plugins' CPU path (their PyTorch references), as the served model does, instead of the Triton
    interpreter that conftest turns on: the same numbers on both sides, and ~100x faster for Dustin."""
    with pytest.MonkeyPatch.context() as patch:
        use_interpreter(patch, False)
        yield


@functools.cache
def _models() -> tuple:
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=WEIGHTS_SEED).model
    draft = load_model("preset:tiny-llama-draft", dtype=torch.float32, seed=WEIGHTS_SEED + 1).model
    return target, draft


@functools.cache
def longspark_drafter():
    """The served LongSpark drafter: `--longspark random` draws it with the draft's seed, as the engine does."""
    return random_longspark(_models()[0], seed=WEIGHTS_SEED + 1)


@functools.cache
def ring_drafter():
    """A random ring drafter of the served target with a ring of 8 rows, which the in-flight parity's prompts
    overrun."""
    return random_ring_drafter(_models()[0], RingDrafterConfig((0, 1), (0, 2), window=8, block=4),
                               seed=WEIGHTS_SEED + 2)


@functools.cache
def served_ring_drafter():
    """The served ring drafter: `--ring random` draws it at random_ring_config's shape with the seed + 2, as the
    engine does."""
    return load_ring_drafter("random", _models()[0], seed=WEIGHTS_SEED + 2)


def direct_text(method: str, text: str, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0, draft=None, ring=None) -> str:
    """The runtime's own answer: decoder.generate([prompt]) on a single-slot decoder, tokens as characters (ring:
    the ring drafter of the ring methods, default ring_drafter())."""
    target, default_draft = _models()
    draft = draft or default_draft
    speculative = METHODS[method].needs_draft  # a draft model and its cache
    decoder = build_decoder(method, MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, 1, MAX_SEQ_LEN, torch.float32, "cpu"),
        backend=get_backend("reference"), draft=draft if speculative else None,
        draft_cache=KVCache.allocate(draft.config, 1, MAX_SEQ_LEN, torch.float32, "cpu") if speculative else None,
        gamma=SERVED.gamma, dustin=DUSTIN, longspark=longspark_drafter(), ring=ring or ring_drafter(),
        use_cuda_graph=False))
    config = GenerationConfig(max_tokens, SamplingParams(temperature, top_p, seed), EOS, prefill_chunk=16)
    with reference_kernels():
        tokens = decoder.generate([[ord(c) for c in text]], config).tokens[0]
    return "".join(chr(t) for t in tokens)


def make_batcher(method: str, slots: int, draft=None, prefill_chunk: int = 16, **batching) -> InflightBatcher:
    """An in-flight batcher of the served tiny pair (fp32, CPU, reference backend); batching: InflightBatcher's
    prefill_budget and prefix_cache."""
    target, default_draft = _models()
    draft = draft or default_draft
    decoder = build_decoder(method, MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, slots, MAX_SEQ_LEN, torch.float32, "cpu"),
        backend=get_backend("reference"), draft=draft,
        draft_cache=KVCache.allocate(draft.config, slots, MAX_SEQ_LEN, torch.float32, "cpu"), gamma=SERVED.gamma,
        draft_budget=SERVED.draft_budget, dustin=DUSTIN, longspark=longspark_drafter(), ring=ring_drafter(),
        use_cuda_graph=False))
    return InflightBatcher(decoder, EOS, prefill_chunk=prefill_chunk, **batching)


def serve_requests(batcher: InflightBatcher, requests: list[SlotRequest]) -> dict[int, list[int]]:
    """Requests admitted in order as slots free up, each slot released when it finishes -> tokens per request."""
    got: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    waiting = list(enumerate(requests))
    with reference_kernels():
        for _ in range(500):  # bounded: every step commits at least one token per active slot
            while waiting and batcher.free_slots:
                k, request = waiting.pop(0)
                slot, update = batcher.admit(request)
                owner[slot], got[k] = k, []
                if update is not None:  # one prefill chunk: the first token now (longer prompts: from step())
                    got[k] += update.tokens
                    if update.finished:
                        batcher.release(slot)
            if not waiting and not batcher.busy:
                break
            for update in batcher.step():
                got[owner[update.slot]] += update.tokens
                if update.finished:
                    batcher.release(update.slot)
    assert not batcher.busy and not waiting
    return got


def run_requests(engine: ServingEngine, requests: list[GenerationRequest], timeout_s: float = 120.0) -> list[list]:
    """Submit every request to the engine at once; wait for all; the chunks each got, in order."""
    chunks: list[list] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def collect(i: int):
        def on_chunk(chunk) -> None:
            chunks[i].append(chunk)
            if chunk.final:
                done[i].set()
        return on_chunk

    for i, r in enumerate(requests):
        engine.submit(r, collect(i))
    for event in done:
        assert event.wait(timeout_s), "a request did not finish"
    return chunks


def wait_ready(process: subprocess.Popen, timeout_s: float = 900) -> tuple[str, list[str]]:
    """Read `trtllm-dustin serve`'s output until its "ready:" line; returns that line and every line read (what the
    failure shows when serve exits first or never gets ready)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line, "serve exited before it was ready:\n" + "".join(lines)
        lines.append(line)
        if line.startswith("ready:"):
            return line, lines
    raise AssertionError(f"serve was not ready within {timeout_s:.0f} s:\n" + "".join(lines))
