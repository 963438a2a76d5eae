"""A request served alone decodes at generate()'s rate on the CPU.

The serving engine runs the one round over every batch slot of caches sized for the longest request, where
generate() decodes one sequence in a cache of exactly its length. On the CPU an idle slot cost a projection row
each (a small GEMM there takes several times a GEMV's time) and every slot's attention read the whole cache: the
default repository (8 slots x 4096) served the default model at a fifth of generate()'s rate. The round now
verifies the busy slots only, up to their longest sequence (runtime/decoder.py). A draft model's steps ran over every
slot too: the default method (dustin-ip-sparse-draft) was served at 0.6 of generate()'s rate until the drafter took
the same busy rows (runtime/drafters/model_drafter.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models import load_model
from trtllm_dustin.models.packaged import DEFAULT_DRAFT, default_dustin_config_path
from trtllm_dustin.runtime.build import build_runtime
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.inflight import InflightBatcher
from trtllm_dustin.serving import ServingConfig
from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine
from trtllm_dustin.serving.text import TokenizerCodec

SLOTS, MAX_SEQ_LEN = 8, 1024  # the served caches: a lone request leaves 7 slots idle and most positions empty
TOKENS = 12
PROMPT = "Write three sentences about why lighthouses were important to sailors."
REPEATS = 4  # back-to-back pairs after a warm-up of each: the two sides of a pair see about the same load from
# other work on the machine (CI runs two test workers on two cores), which only ever slows a run down


@pytest.mark.parametrize("method", ["vanilla", "dustin-ip-sparse-draft"])  # the default's draft model and set
def test_a_lone_served_request_decodes_at_generates_rate(smollm2, plugin_references, method: str) -> None:
    model, codec = smollm2.model, TokenizerCodec(smollm2.tokenizer)
    prompt = codec.encode(PROMPT)
    draft = None if method == "vanilla" else load_model(DEFAULT_DRAFT, share_with=model).model
    dustin = DustinConfig.from_json(default_dustin_config_path().read_text())

    def decoder(slots: int, max_seq_len: int):
        return build_runtime(method, model, draft=draft, dustin=dustin, batch_slots=slots, max_seq_len=max_seq_len,
                             dtype=torch.float32, backend="reference")

    alone = decoder(1, len(prompt) + TOKENS + 4)  # as `trtllm-dustin generate` sizes its cache (+ Γ + 1)
    served = ServingConfig(methods=(method,), draft=None if draft is None else DEFAULT_DRAFT, dustin=dustin,
                           max_batch=SLOTS, max_seq_len=MAX_SEQ_LEN)
    engine = ServingEngine(served,
                           {method: InflightBatcher(decoder(SLOTS, MAX_SEQ_LEN))}, codec)
    texts: dict[str, list[str]] = {"generate": [], "served": []}

    def generated() -> float:
        result = alone.generate([prompt], GenerationConfig(TOKENS))
        texts["generate"].append(codec.decode(result.tokens[0]))
        return result.decode_tokens_per_s

    def served() -> float:
        done, chunks = threading.Event(), []
        engine.submit(GenerationRequest(PROMPT, TOKENS, method=method),
                      lambda c: (chunks.append(c), c.final and done.set()))
        assert done.wait(300), "the served request did not finish"
        assert chunks[-1].error is None and chunks[-1].stats.generated_tokens == TOKENS
        texts["served"].append(chunks[-1].text)
        return chunks[-1].stats.decode_tokens_per_s

    try:
        generated(), served()  # warm-up: first-call allocations and kernel choices stay out of the rates
        rates: dict[str, list[float]] = {"generate": [], "served": []}
        for _ in range(REPEATS):
            rates["generate"].append(generated())
            rates["served"].append(served())
    finally:
        engine.close()
    assert set(texts["served"]) == set(texts["generate"]) and len(set(texts["served"])) == 1  # the same work
    # the best pair: a lone spike of either side in one pair (the other worker idle for a moment) does not decide
    ratios = [served / alone for served, alone in zip(rates["served"], rates["generate"], strict=True)]
    assert max(ratios) >= 0.8, f"tokens/s: {rates}"
