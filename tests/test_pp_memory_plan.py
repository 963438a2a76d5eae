"""Pipeline stage memory (engine.py stage_bytes, benchmarks/pp_memory_plan.py) against whole-model sums."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trtllm_dustin.build_engines.engine import stage_bytes
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.runtime.pipeline import layer_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pp_memory_plan  # noqa: E402


@pytest.mark.parametrize("target, draft", [("qwen2.5-14b", "qwen2.5-0.5b"), ("llama-3.3-70b", "llama-3.2-1b"),
                                           ("smollm2-135m", "qwen2.5-0.5b")])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stages_add_up_to_the_pair(target: str, draft: str, pp: int) -> None:
    """The stages hold every parameter once (a tied embedding twice when first and last stage differ: the head
    reuses it) and every layer's cache once; the draft and its cache sit on the first stage."""
    t, d = get_preset(target), get_preset(draft)
    configs = {"target": t, "draft": d}
    layers = layer_split(t.num_layers, pp)
    stages = [stage_bytes(configs, layers, rank, 16, 4096, torch.bfloat16) for rank in range(pp)]
    tied_copy = t.vocab_size * t.hidden_size if t.tie_word_embeddings and pp > 1 else 0
    assert sum(w for w, _ in stages) == 2 * (t.num_parameters() + d.num_parameters() + tied_copy)
    kv_t = KVCache.nbytes_for(t, 16, 4096, torch.bfloat16)
    kv_d = KVCache.nbytes_for(d, 16, 4096, torch.bfloat16)
    assert sum(c for _, c in stages) == pytest.approx(kv_t + kv_d, rel=1e-9)
    assert stages[0][1] >= kv_d and all(c < stages[0][1] + 1 for _, c in stages)


def test_the_plans_say_what_needs_more_than_one_gpu() -> None:
    assert pp_memory_plan.plan("qwen2.5-14b", "qwen2.5-0.5b", 1, 16, 16384)["fits"]
    assert not pp_memory_plan.plan("qwen2.5-14b", "qwen2.5-0.5b", 1, 16, 32768)["fits"]  # issue 27's reason for PP
    assert not pp_memory_plan.plan("qwen2.5-72b", "qwen2.5-0.5b", 2, 16, 32768)["fits"]
    assert pp_memory_plan.plan("qwen2.5-72b", "qwen2.5-0.5b", 4, 16, 32768)["fits"]
