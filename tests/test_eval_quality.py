"""benchmarks/eval_quality.py: the teacher-forced driver against one full forward, the intervals, the scorers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_speculative import DTYPE, dustin_config

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.methods import MethodSetup, build_decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_quality  # noqa: E402
import quality_tasks  # noqa: E402

PROMPTS = [[5 + (7 * i) % 200 for i in range(40)], [250 - (3 * i) % 90 for i in range(29)]]
CONTINUATION = [[(11 * i + 3) % 257 for i in range(12)], [(5 * i + 1) % 257 for i in range(12)]]


def full_forward_logprobs(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log p(continuation[i] | prompt, continuation[:i]) distributions from one uncached forward: [n, V]."""
    tokens = prompt + continuation
    cache = KVCache.allocate(target.config, 1, len(tokens) + 4, DTYPE, "cpu")
    with torch.inference_mode():
        logits = target(torch.tensor([tokens]), cache, AttentionMetadata(torch.zeros(1, dtype=torch.int32)),
                        get_backend("reference"))
    return torch.log_softmax(logits[0, len(prompt) - 1: len(tokens) - 1].float(), -1)


@pytest.mark.parametrize("method", ["classic", "streamingllm", "snapkv"])
def test_teacher_forced_logprobs_equal_one_full_forward_when_lossless(method: str) -> None:
    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=DTYPE, seed=8).model
    backend = get_backend("reference")
    pre = eval_quality.prefill_batch(target, draft, PROMPTS, 64, DTYPE, torch.device("cpu"), backend)
    setup = MethodSetup(target=target, target_cache=pre.tcache, backend=backend, draft=draft,
                        draft_cache=pre.draft_work, dustin=dustin_config(budget=64, m=4), use_cuda_graph=False)
    decoder = build_decoder(method, setup)
    forced = eval_quality.decode(decoder, pre, 12, teacher=CONTINUATION)
    assert forced["tokens"] == CONTINUATION  # the run followed the text, whatever the drafts
    for b in range(2):
        torch.testing.assert_close(forced["logprobs"][b], full_forward_logprobs(target, PROMPTS[b], CONTINUATION[b]),
                                   rtol=1e-4, atol=1e-4)
    metrics = eval_quality.book_metrics(forced["logprobs"][0], forced["logprobs"][0], CONTINUATION[0])
    assert metrics["kl"] == 0 and metrics["top1_agreement"] == 1
    free = eval_quality.decode(decoder, pre, 12)  # the shared prefill is reusable: same greedy run twice
    assert free["tokens"] == eval_quality.decode(decoder, pre, 12)["tokens"]


def test_wilson_and_bootstrap_intervals() -> None:
    lo, hi = eval_quality.wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
    lo, hi = eval_quality.bootstrap([0.0, 1.0] * 50)
    assert lo < 0.5 < hi and hi - lo < 0.25
    assert eval_quality.summarise([1.0, 0.0, 1.0])["ci"] == "wilson"


def test_scorers() -> None:
    code = quality_tasks.Sample("code", "x", [1], references=["    return a + b"])
    assert quality_tasks.score(code, "\n    return a + b\n    pass") == {"exact_match": 1.0, "edit_similarity": 1.0}
    assert quality_tasks.score(code, "\n    return a - b")["exact_match"] == 0.0
    needle = quality_tasks.Sample("needle", "y", [1], references=["1234567", "7654321"])
    assert quality_tasks.score(needle, " 1234567 and 765432") == {"string_match": 0.5}
