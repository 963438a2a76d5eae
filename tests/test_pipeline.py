"""Pipeline parallelism (runtime/pipeline/) on the CPU with gloo, against the single-process runtime.

Every method the pipeline runs gives `build_decoder(...).generate`'s tokens, greedy and seeded sampling, on 2 and 3
processes, with and without micro-batches. With micro-batches the batch's one generator cannot be shared by
micro-batches in flight, so seeded sampling is compared with per-slot generators there: slot b's tokens must be those
of a single-slot `generate([prompt_b])` seeded seed + b (greedy runs compare with the batched generate either way).
The stage chain itself is checked in one process against the whole model, bit for bit.

The ranks are plain processes given torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that
nothing but the pipeline's own fault handling stops them (test_pipeline_faults.py); the launching, the models and the
configs are in tests/helpers/pipeline.py, shared with the fault and engine tests.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from helpers.kernels import use_interpreter
from helpers.models import DEVICES
from helpers.pipeline import (
    BATCH,
    CONFIGS,
    DTYPE,
    DUSTIN,
    GAMMA,
    PROMPTS,
    S_MAX,
    Launch,
    longspark,
    models,
    pipeline_decoder,
)

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import QueryCapture
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.methods import METHODS, MethodSetup
from trtllm_dustin.runtime.pipeline import PIPELINE_METHODS, PipelineStage, pipeline_method

REQUIRED = ["vanilla", "classic", "magicdec", "dustin-h", "dustin-h-sparse-draft", "dustin-ip-sparse-draft"]
EXTRA = ["dustin-t", "dustin-d", "streamingllm", "dustin-ip"]  # also split; greedy, 2 processes, one micro-batch
# The LongSpark draft, whose layers 1 and 2 live on the first and the last stage of 2, a middle and the last of 3:
# greedy on 2 and 3 processes, one micro-batch and one per stage; dustin-t-longspark as EXTRA. Its summaries fold
# the prompt rows up to the batch's longest prompt (the masked rows' zero weights change the sums' rounding), so a
# micro-batch's tokens are those of a single-process batch of the micro-batch's slots.
LONGSPARK = ["longspark", "dustin-h-longspark", "dustin-ip-longspark"]
LONGSPARK_EXTRA = ["dustin-t-longspark"]
MICRO = {2: 2, 3: 3}  # micro-batches of the micro-batched runs: one per stage keeps every stage busy


@contextmanager
def one_thread():
    """The CPU has 2 cores and other tests beside: torch's second thread only contends."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- the jobs ----------------------------------------------------------------------------------------------------
def run_cases(group, payload, record) -> None:
    """Every (method, sampling, micro-batches) case on this rank: record["result"], the tokens generate returned."""
    target, draft = models()
    record["result"] = {}
    for method, sampling, micro in payload["cases"]:
        decoder = pipeline_decoder(group, method, micro, target, draft)
        record["result"][f"{method}/{sampling}/{micro}"] = decoder.generate(PROMPTS, CONFIGS[sampling]).tokens


def cases(world: int) -> list[tuple[str, str, int]]:
    runs = [(m, s, micro) for m in REQUIRED for s in CONFIGS for micro in (1, MICRO[world])]
    runs += [(m, "greedy", micro) for m in LONGSPARK for micro in (1, MICRO[world])]
    return runs + ([(m, "greedy", 1) for m in EXTRA + LONGSPARK_EXTRA] if world == 2 else [])


def micro_batch_sizes(micro: int) -> list[int]:
    """The slots of each micro-batch, as PipelineDecoder splits the batch."""
    return [BATCH // micro + (m < BATCH % micro) for m in range(micro)]


def reference(method: str, sampling: str, per_slot: bool, split: int = 1) -> list[list[int]]:
    """The single-process runtime on the whole model: the batch at once, or (per_slot) each prompt alone in a
    one-slot decoder seeded seed + its index; split (greedy): the batch as `split` micro-batches, each a
    single-process batch of its slots."""
    target, draft = models()
    config = CONFIGS[sampling]

    def decoder(slots: int):
        return build_decoder(method, MethodSetup(
            target=target, target_cache=KVCache.allocate(target.config, slots, S_MAX, DTYPE, "cpu"),
            backend=get_backend("reference"), draft=draft,
            draft_cache=KVCache.allocate(draft.config, slots, S_MAX, DTYPE, "cpu"), gamma=GAMMA, draft_budget=12,
            dustin=DUSTIN, longspark=longspark(target)))

    if split > 1:
        starts = [sum(micro_batch_sizes(split)[:m]) for m in range(split)]
        return [row for a, n in zip(starts, micro_batch_sizes(split), strict=True)
                for row in decoder(n).generate(PROMPTS[a: a + n], config).tokens]
    if not per_slot:
        return decoder(BATCH).generate(PROMPTS, config).tokens
    seeded = [replace(config, sampling=replace(config.sampling, seed=config.sampling.seed + b)) for b in range(BATCH)]
    return [decoder(1).generate([prompt], c).tokens[0] for prompt, c in zip(PROMPTS, seeded, strict=True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[int, list[dict]], dict[tuple[str, str, bool], list[list[int]]]]:
    """(world -> each rank's record of every case, the references). Both launches and the references run at once:
    a pipeline's stages wait on one another, and the cores they leave idle do the rest."""
    launches = {world: Launch(world, run_cases, {"cases": cases(world)}, tmp_path_factory.mktemp(f"pp{world}"))
                for world in (2, 3)}
    with pytest.MonkeyPatch.context() as patch, one_thread():
        use_interpreter(patch, False)  # the plugins' references on the CPU, as in the ranks
        # greedy tokens do not depend on the generators: one batched reference serves the micro-batched runs too
        wanted = [(m, "greedy", False) for m in REQUIRED + EXTRA + LONGSPARK + LONGSPARK_EXTRA] + \
            [(m, "sampled", per_slot) for m in REQUIRED for per_slot in (False, True)]
        refs = {case: reference(*case) for case in wanted}
        refs |= {(m, "greedy", False, micro): reference(m, "greedy", False, micro)
                 for m in LONGSPARK for micro in set(MICRO.values())}
    # The comparisons below can fail: sparse verification changes the text, sampling changes it, and per-slot
    # generators draw other numbers than the batch's one.
    assert refs["dustin-h", "greedy", False] != refs["vanilla", "greedy", False]
    # LongSpark drafts other tokens than the draft model, and its sparse verifications change the text
    assert len({str(refs[m, "greedy", False]) for m in LONGSPARK + ["classic", "vanilla"]}) >= 3
    for m in REQUIRED:
        assert refs[m, "greedy", False] != refs[m, "sampled", False] != refs[m, "sampled", True]
        assert all(len(t) == CONFIGS["greedy"].max_new_tokens for t in refs[m, "greedy", False])
    return {world: ranks.join() for world, ranks in launches.items()}, refs


@pytest.mark.parametrize("micro", [False, True], ids=["one-batch", "micro-batches"])
@pytest.mark.parametrize("sampling", list(CONFIGS))
@pytest.mark.parametrize("method", REQUIRED)
@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_equals_the_single_process_runtime(runs, world: int, method: str, sampling: str, micro: bool
                                                    ) -> None:
    records, references = runs[0][world], runs[1]
    assert all("error" not in r and r["exitcode"] == 0 for r in records), [r.get("traceback") for r in records]
    key = f"{method}/{sampling}/{MICRO[world] if micro else 1}"
    expected = references[method, sampling, micro and sampling == "sampled"]
    for record in records:  # every rank holds the run's Progress and returns the same tokens
        assert record["result"][key] == expected


@pytest.mark.parametrize("micro", [False, True], ids=["one-batch", "micro-batches"])
@pytest.mark.parametrize("method", LONGSPARK)
@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_longspark_equals_the_single_process_runtime(runs, world: int, method: str, micro: bool) -> None:
    """The LongSpark draft on the first stage reads target layers held by later stages (their K/V and hidden states
    come round the chain: runtime/runtime/pipeline/longspark.py) and drafts the single-process tokens, greedy."""
    records, references = runs[0][world], runs[1]
    assert all("error" not in r and r["exitcode"] == 0 for r in records), [r.get("traceback") for r in records]
    key = f"{method}/greedy/{MICRO[world] if micro else 1}"
    expected = references[method, "greedy", False, MICRO[world]] if micro else references[method, "greedy", False]
    for record in records:
        assert record["result"][key] == expected


@pytest.mark.parametrize("method", EXTRA + LONGSPARK_EXTRA)
def test_other_split_methods_equal_the_single_process_runtime(runs, method: str) -> None:
    records, references = runs
    for record in records[2]:
        assert record["result"][f"{method}/greedy/1"] == references[method, "greedy", False]


# ---- in one process ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device,fused", [("cpu", False), ("cpu", True)] + [("cuda", None)] * ("cuda" in DEVICES))
@pytest.mark.parametrize("pp_size", [2, 3])
def test_a_stage_chain_is_the_whole_model(pp_size: int, device: str, fused: bool | None,
                                          plugin_references) -> None:
    """Stages over caches of their own layers reproduce Transformer.forward: the logits, every layer's new K/V, and
    the queries captured by global layer (into NaN-poisoned buffers). Bit for bit on the CPU in fp32, on the module
    path and on the fused one (the kernels' references); on CUDA (bf16, the fused kernels) up to the residual add
    that the stage boundary takes out of the next layer's fused norm."""
    from trtllm_dustin.plugins.kernel_config import KernelConfig
    from trtllm_dustin.runtime.pipeline import layer_split

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else DTYPE
    target = load_model("preset:tiny-llama", device=device, dtype=dtype, seed=7).model
    target.kernels = KernelConfig(fused_elementwise=fused)  # the stages take the model's
    config, backend = target.config, get_backend("triton" if cuda else "reference")
    close = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=0, atol=0)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    lengths = torch.tensor([5, 11], dtype=torch.int32, device=device)  # a random context the new tokens attend to
    shape = (config.num_layers, 2, config.num_kv_heads, 32, config.head_dim)
    context_k = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    context_v = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    layers = (1, 2)

    def capture() -> QueryCapture:
        return QueryCapture(layers, {layer: torch.full((2, 9, config.num_heads, config.head_dim), float("nan"),
                                                       dtype=dtype, device=device) for layer in layers})

    with torch.inference_mode():
        whole = KVCache(context_k.clone(), context_v.clone(), lengths.clone())
        expected_capture = capture()
        expected = target(tokens, whole, AttentionMetadata(cache_seqlens=whole.seqlens), backend,
                          capture=expected_capture)
        x, got_capture = tokens, capture()
        for rank, (start, stop) in enumerate(layer_split(config.num_layers, pp_size)):
            stage = PipelineStage.from_model(target, start, stop, rank, pp_size)
            local = stage.allocate_cache(2, 32, dtype, device)
            assert local.num_layers == stop - start
            local.k.copy_(context_k[start:stop])
            local.v.copy_(context_v[start:stop])
            local.seqlens.copy_(lengths)
            x = stage(x, local, AttentionMetadata(cache_seqlens=local.seqlens), backend, capture=got_capture)
            assert x.shape == ((2, 9, config.vocab_size) if stage.last else (2, 9, config.hidden_size))
            torch.testing.assert_close(local.k, whole.k[start:stop], **close)
            torch.testing.assert_close(local.v, whole.v[start:stop], **close)
    torch.testing.assert_close(x, expected, **close)
    for layer in layers:
        torch.testing.assert_close(got_capture.queries[layer], expected_capture.queries[layer], **close)


def test_every_registry_method_runs_split_or_refuses_with_the_fix() -> None:
    assert set(REQUIRED + EXTRA + LONGSPARK + LONGSPARK_EXTRA) == set(PIPELINE_METHODS)
    assert set(PIPELINE_METHODS) <= set(METHODS)
    for name in METHODS:
        if name not in PIPELINE_METHODS:
            with pytest.raises(ConfigError, match=f"method {name} does not run pipeline-parallel .*--pp-size 1"):
                pipeline_method(name)
