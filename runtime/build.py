"""The one place a decoder is assembled: kernel configuration -> tactics -> attention backend -> KV caches -> the
method's (Drafter, Selector) pair (methods.py) -> Decoder.

Every entry point calls `build_runtime`: `generate` (cli.py), the serving engine, the pipeline's first stage, the
quality and tau evaluations and the benchmarks. Each passes what it has already (models, a Dustin config, caches
holding a shared prefill, a backend shared with that prefill) and the factory builds the rest the same way for all.
`build_decoder` is its last step, the method over a complete MethodSetup, for tests that hand-build every part.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from trtllm_dustin.attention import AttentionBackend, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.longspark import LongSpark
from trtllm_dustin.models.ring_drafter import RingDrafter
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.methods import Method, MethodSetup, method_spec

__all__ = ["attention_backend", "build_decoder", "build_runtime", "runtime_kernels"]


def runtime_kernels(kernels: KernelConfig | None = None, tactics: str | Path | None = None) -> KernelConfig:
    """The kernel configuration a runtime runs with: `kernels` (None: KernelConfig(), the defaults; entry points pass
    KernelConfig.from_env()) with an engine's own tuned tactic table, when it has one, for the skinny GEMMs (a table
    of bf16 weights: `linear_tactics`; int8 weights keep `kernels.int8_linear_tactics`)."""
    kernels = KernelConfig() if kernels is None else kernels
    return kernels if tactics is None else replace(kernels, linear_tactics=str(tactics))


def attention_backend(device: torch.device | str, kernels: KernelConfig | None = None, name: str | None = None
                      ) -> AttentionBackend:
    """The attention backend `name` (None: "triton" on CUDA, "reference" elsewhere), launching as `kernels` says."""
    return get_backend(name or ("triton" if torch.device(device).type == "cuda" else "reference"), kernels)


def build_runtime(method: str, target: Transformer, *, draft: Transformer | None = None,
                  longspark: LongSpark | None = None, dustin: DustinConfig | None = None,
                  batch_slots: int | None = None, max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                  draft_kv_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                  target_cache: KVCache | None = None, draft_cache: KVCache | None = None,
                  kernels: KernelConfig | None = None, tactics: str | Path | None = None,
                  backend: str | AttentionBackend | None = None, gamma: int = 3, draft_budget: int = 512,
                  use_cuda_graph: bool = True, longspark_kv: Mapping | None = None,
                  ring: RingDrafter | None = None) -> Decoder:
    """The decoder of registered `method` over `target` (a Transformer, or a pipeline's first stage).

    Caches: `target_cache` when given (a shared prefill, a pipeline stage's own layers), else one of batch_slots x
    max_seq_len in `dtype` on `device` (None: the target's weights' device); `draft_cache` when given, else, for a
    method with a draft model, one of the target cache's size in `draft_kv_dtype` (None: the draft's weight dtype).
    The draft model and its cache are used only by methods that draft with it. Kernels: runtime_kernels(kernels,
    tactics), given to the models, the backend and the round's ops. backend: a registered name (attention_backend's
    default for None), built with those kernels, or a built backend used as it is (one a prefill beside the decoder
    shares). longspark_kv: a pipeline's first stage hands the LongSpark drafter the later stages' K/V of the layers it
    reads (runtime/pipeline/longspark.py); its `longspark` is then attached to the whole model elsewhere. ring: the
    ring drafter of the ring methods (attached to `target`).
    Every check that needs no memory (the method, its models, its config) runs before a cache is allocated.
    """
    spec = method_spec(method)
    if not spec.needs_draft:  # vanilla and the LongSpark methods: no draft model, no draft cache
        draft, draft_cache = None, None
    if device is None:
        device = target_cache.seqlens.device if target_cache is not None else next(target.parameters()).device
    device = torch.device(device)
    _check_inputs(method, spec, target, draft, longspark, dustin, use_cuda_graph, device,
                  relayed=longspark_kv is not None, ring=ring)
    kernels = runtime_kernels(kernels, tactics)
    if backend is None or isinstance(backend, str):
        backend = attention_backend(device, kernels, backend)
    if target_cache is None:
        if batch_slots is None or max_seq_len is None or dtype is None:
            raise ValueError(f"{method}: without a target cache, batch_slots, max_seq_len and dtype size one")
        target_cache = KVCache.allocate(target.config, batch_slots, max_seq_len, dtype, device)
    if draft is not None and draft_cache is None:
        draft_cache = KVCache.allocate(draft.config, target_cache.batch_slots, target_cache.max_seq_len,
                                       draft_kv_dtype or draft.embed.weight.dtype, device)
    return build_decoder(method, MethodSetup(
        target=target, target_cache=target_cache, backend=backend, draft=draft, draft_cache=draft_cache, gamma=gamma,
        draft_budget=draft_budget, dustin=dustin, longspark=longspark, longspark_kv=longspark_kv, ring=ring,
        use_cuda_graph=use_cuda_graph, kernels=kernels))


def build_decoder(method: str, setup: MethodSetup) -> Decoder:
    """The Decoder of a registered method over a complete setup (build_runtime's last step; tests that build every
    part themselves call it), checked before anything is allocated beyond the caches given."""
    spec = method_spec(method)
    tcache = setup.target_cache
    if spec.needs_draft and setup.draft_cache is None:
        raise ConfigError(f"method {method} needs a draft model; pass --draft DIR|FILE.gguf|preset:NAME")
    _check_inputs(method, spec, setup.target, setup.draft, setup.longspark, setup.dustin, setup.use_cuda_graph,
                  tcache.seqlens.device, relayed=setup.longspark_kv is not None, ring=setup.ring)
    if spec.needs_draft:
        dcache = setup.draft_cache
        if (tcache.batch_slots, tcache.max_seq_len) != (dcache.batch_slots, dcache.max_seq_len):
            raise ValueError(f"target and draft caches must have the same batch slots and max_seq_len; got "
                             f"{tcache.batch_slots} x {tcache.max_seq_len} and {dcache.batch_slots} x "
                             f"{dcache.max_seq_len}")
    models = (setup.target, setup.draft) if spec.needs_draft else (setup.target,)
    for model in models:  # read once here; the graphs record what they were captured with
        model.kernels = setup.kernels
    device = tcache.seqlens.device
    graphs = PhaseGraphs(setup.use_cuda_graph and device.type == "cuda", setup.kernels)
    drafter = spec.drafter(setup, graphs)
    selector = spec.selector(setup, drafter)
    if (selector.budget is not None) != spec.sparse:
        raise RuntimeError(f"method {method}: its registry entry says sparse={spec.sparse}, its selector disagrees")
    shared_vocab = setup.draft.config.vocab_size if spec.needs_draft else setup.target.config.vocab_size
    return Decoder(method, setup.target, tcache, drafter, selector, setup.backend, graphs, setup.kernels,
                   shared_vocab)


def _check_inputs(method: str, spec: Method, target: Transformer, draft: Transformer | None,
                  longspark: LongSpark | None, dustin: DustinConfig | None, use_cuda_graph: bool,
                  device: torch.device, relayed: bool = False, ring: RingDrafter | None = None) -> None:
    """What the method needs beside the target, each refusal naming the option that gives it (relayed: a pipeline's
    first stage hands the LongSpark drafter the later stages' K/V, so its target is the whole model elsewhere)."""
    if spec.needs_draft and draft is None:
        raise ConfigError(f"method {method} needs a draft model; pass --draft DIR|FILE.gguf|preset:NAME")
    if spec.needs_longspark and longspark is None:
        raise ConfigError(f"method {method} needs a LongSpark drafter; pass --longspark DIR (default with the default "
                          "model: the packaged one)")
    if spec.needs_longspark and not relayed and longspark.target is not target:
        raise ConfigError(f"method {method}: the LongSpark drafter is attached to another target model than this one")
    if spec.needs_ring and ring is None:
        raise ConfigError(f"method {method} needs a ring drafter; pass --ring DIR (from `trtllm-dustin "
                          "train-ring-drafter`)")
    if spec.needs_ring and ring.target is not target:
        raise ConfigError(f"method {method}: the ring drafter is attached to another target model than this one")
    if spec.eager_only and use_cuda_graph and device.type == "cuda":
        raise ConfigError(f"{method} decides on the host round by round and cannot run in CUDA graphs; build it with "
                          "use_cuda_graph=False (it is evaluation only)")
    if spec.needs_dustin and dustin is None:
        raise ConfigError(f"{method} needs a Dustin configuration (SRH layers/heads, budget, m); pass "
                          "--dustin-config FILE, written by `trtllm-dustin search` for this target/draft pair")
