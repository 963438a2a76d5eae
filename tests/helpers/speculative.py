"""What the round's end-to-end tests share (test_speculative.py, the baselines, the fidelity selectors, the registry,
bench_e2e and eval_quality tests): a tiny-llama target and its draft with random weights, four ragged prompts, a small
Dustin config, and `run`, which decodes the prompts with one registry method.

`env` and `vanilla_tokens` are module-scoped fixtures: a test module binds them (`env = speculative.env`) to get its
own instance."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers.models import DEVICES
from trtllm_dustin.attention import get_backend
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.longspark import LongSpark, random_longspark
from trtllm_dustin.models.ring_drafter import RingDrafter, RingDrafterConfig, random_ring_drafter
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import METHODS, MethodSetup

__all__ = ["DTYPE", "GAMMA", "PROMPTS", "S_MAX", "Env", "dustin_config", "env", "run", "vanilla_tokens"]

DTYPE = torch.float32
GAMMA = 3
S_MAX = 160
PROMPTS = [list(range(5, 5 + 70)), [9, 8, 7], list(range(100, 100 + 41)), [200 + i % 13 for i in range(55)]]


@dataclass
class Env:
    target: Transformer
    draft: Transformer
    device: torch.device
    backend: str  # the CPU runs the PyTorch reference eagerly; CUDA runs the Triton kernels from CUDA graphs
    spark: LongSpark | None = None  # a random LongSpark drafter of the target (window 8: most contexts outgrow it)
    ring: RingDrafter | None = None  # a random ring drafter of the target (ring of 8 rows, so is it)


@pytest.fixture(scope="module", params=DEVICES)
def env(request: pytest.FixtureRequest) -> Env:
    device = torch.device(request.param)
    target = load_model("preset:tiny-llama", device=device, dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", device=device, dtype=DTYPE, seed=8).model
    spark = random_longspark(target, seed=9, window=8, summary=4, block=4)
    ring = random_ring_drafter(target, RingDrafterConfig((0, 1), (0, 2), window=8, block=4), seed=10)
    return Env(target, draft, device, "triton" if device.type == "cuda" else "reference", spark, ring)


def dustin_config(budget: int, m: int, n_recent: int = 16) -> DustinConfig:
    return DustinConfig(target_layers=(LayerHeads(1, (0, 4)),),
                        draft_layers=(LayerHeads(0, (1,)), LayerHeads(1, (2, 3))),
                        budget=budget, m=m, n_sink=4, n_recent=n_recent, gamma=GAMMA,
                        selection_layers=(LayerHeads(1, tuple(range(6))),))


def run(method: str, env: Env, draft: Transformer | None = None, dustin=None, max_new=24, **config):
    draft = draft or env.draft
    target_cache = KVCache.allocate(env.target.config, 4, S_MAX, DTYPE, env.device)
    setup = MethodSetup(target=env.target, target_cache=target_cache,
                        backend=get_backend(env.backend), draft=draft,
                        draft_cache=KVCache.allocate(draft.config, 4, S_MAX, DTYPE, env.device), gamma=GAMMA,
                        draft_budget=12, dustin=dustin, longspark=env.spark, ring=env.ring,
                        use_cuda_graph=not METHODS[method].eager_only)
    decoder = build_decoder(method, setup)
    return decoder, decoder.generate(PROMPTS, GenerationConfig(max_new_tokens=max_new, prefill_chunk=32, **config))


@pytest.fixture(scope="module")
def vanilla_tokens(env: Env):
    return run("vanilla", env)[1].tokens
