"""PipelineDecoder.bench, the pipeline mode of benchmarks/bench_e2e.py, on the CPU with gloo.

A benchmark's pipeline starts every slot as if a prompt had just been prefilled (no prefill runs) and times rounds
with the last stage's stated acceptance. With one micro-batch the stated acceptor draws the same numbers, in the same
order, as in the single process, so the rounds commit the same tokens as the single-process Decoder started the same
way (bench_e2e.start_at) with the same acceptor seed: the comparison checks the bench path's hooks, the verdict's
travel and the commit on every rank. With micro-batches every rank must commit what the last stage decided, and
each rank's phase timer holds its own phases. The split that gives the drafting rank fewer layers runs the same
rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.pipeline import BATCH, DTYPE, DUSTIN, GAMMA, S_MAX, Launch, longspark, models, pipeline_decoder

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.methods import METHODS, MethodSetup
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from stated_acceptance import StatedAcceptor, stated_acceptance  # noqa: E402

CONTEXT, ROUNDS, TAU, ACCEPT_SEED, FIRST_SEED = 60, 6, 2.6, 11, 4
METHODS_RUN = ["vanilla", "classic", "dustin-h", "dustin-ip-sparse-draft", "dustin-h-longspark"]


def bench_cases(group, payload, record) -> None:
    target, draft = models()
    record["result"] = {}
    for method, micro, layers in payload["cases"]:
        changes = {} if layers is None else {"layers": tuple(tuple(r) for r in layers)}
        decoder = pipeline_decoder(group, method, micro, target, draft, **changes)
        probs, _ = stated_acceptance(TAU, GAMMA)
        acceptor = StatedAcceptor(probs, seed=ACCEPT_SEED, use_kernel=False) \
            if group.last and decoder.gamma else None
        timer = PhaseTimer(True, torch.device("cpu"))
        out = decoder.bench(CONTEXT, ROUNDS, acceptor, timer, seed=FIRST_SEED)
        record["result"][f"{method}/{micro}/{layers}"] = {
            "committed": out.committed, "rounds": out.rounds, "ms": out.ms, "slots": out.slots,
            "tokens": [row for mb in decoder.micro for row in mb.progress.tokens(mb.prompts)],
            "phases": sorted(timer.totals_ms()), "shared_vocab": decoder.shared_vocab}
    try:
        pipeline_decoder(group, "classic", 1, target, draft).bench(S_MAX, 1)
    except ConfigError as e:
        record["refused"] = str(e)


def single_process(method: str, shared_vocab: int) -> list[list[int]]:
    """The single-process Decoder started as bench_e2e.start_at starts it (zero caches: the pipeline's are zero too),
    ROUNDS rounds with the same stated acceptor."""
    target, draft = models()
    decoder = build_decoder(method, MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, BATCH, S_MAX, DTYPE, "cpu"),
        backend=get_backend("reference"), draft=draft,
        draft_cache=KVCache.allocate(draft.config, BATCH, S_MAX, DTYPE, "cpu"), gamma=GAMMA, draft_budget=12,
        dustin=DUSTIN, longspark=longspark(target)))
    first = torch.randint(0, shared_vocab, (BATCH,), generator=torch.Generator().manual_seed(FIRST_SEED))
    prompts = [[int(t)] * CONTEXT for t in first.tolist()]
    c = target.config
    queries = {layer: torch.zeros(BATCH, c.num_heads, c.head_dim) for layer in decoder.target_query_layers}
    hidden = {layer: torch.zeros(BATCH, c.hidden_size) for layer in decoder.target_hidden_layers}
    width = ROUNDS * (GAMMA + 1) + 1
    with torch.inference_mode():
        decoder.prefilled(slice(0, BATCH), prompts, queries, hidden)
        progress = Progress.allocate(BATCH, width, decoder.gamma, (), torch.device("cpu"))
        decoder.begin(progress, slice(0, BATCH), first, prompts, width)
        sampling = SlotSampling.batch(SamplingParams(), BATCH, torch.device("cpu"), use_kernel=False)
        acceptor = StatedAcceptor(stated_acceptance(TAU, GAMMA)[0], seed=ACCEPT_SEED, use_kernel=False) \
            if decoder.gamma else None
        for _ in range(ROUNDS):
            decoder.round(progress, sampling, acceptor)
    return progress.tokens(BATCH)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = [(m, 1, None) for m in METHODS_RUN] + [("dustin-ip-sparse-draft", 2, None), ("classic", 2, None),
                                                    ("dustin-h", 1, [[0, 1], [1, 3]])]
    launch = Launch(2, bench_cases, {"cases": cases}, tmp_path_factory.mktemp("bench"))
    return launch.join()


def test_one_micro_batch_commits_what_the_single_process_commits(runs) -> None:
    ranks = runs
    assert all("error" not in r for r in ranks), [r.get("traceback") for r in ranks]
    distinct = set()
    for method in METHODS_RUN:
        key = f"{method}/1/None"
        mine = [r["result"][key] for r in ranks]
        expected = single_process(method, mine[0]["shared_vocab"])
        for rank in mine:
            assert rank["tokens"] == expected, (method, rank["tokens"], expected)
            assert rank["rounds"] == ROUNDS and rank["slots"] == BATCH and rank["ms"] > 0
            assert rank["committed"] == sum(len(row) for row in expected)
        distinct.add(str(expected))
        g = 0 if method == "vanilla" else GAMMA
        # every round commits 1 .. Γ + 1 tokens per slot; the stated acceptance accepts some drafts
        assert BATCH * (1 + ROUNDS) <= mine[0]["committed"] <= BATCH * (1 + ROUNDS * (g + 1))
        if g:
            assert mine[0]["committed"] > BATCH * (1 + ROUNDS)
    assert len(distinct) >= 3  # the methods' rounds differ: the comparison can fail


def test_micro_batches_and_the_lighter_first_stage_agree_on_every_rank(runs) -> None:
    for key in ("dustin-ip-sparse-draft/2/None", "classic/2/None", "dustin-h/1/[[0, 1], [1, 3]]"):
        first, last = (r["result"][key] for r in runs)
        assert first["tokens"] == last["tokens"] and first["committed"] == last["committed"]
        assert first["rounds"] == ROUNDS
    # the split moves layer 1 (an SRH layer) to rank 1: the same rounds, S_target now sent across
    assert runs[0]["result"]["dustin-h/1/[[0, 1], [1, 3]]"]["tokens"] == runs[0]["result"]["dustin-h/1/None"]["tokens"]


def test_each_rank_times_its_own_phases(runs) -> None:
    first, last = (r["result"]["dustin-h/1/None"]["phases"] for r in runs)
    assert {"draft", "select", "forward", "send", "wait", "commit"} <= set(first) and "accept" not in first
    assert {"wait", "forward", "accept", "commit"} <= set(last) and "draft" not in last
    assert "history" in last  # SRH layer 2 lives on the last stage: it scores S_target for the first


def test_a_bench_longer_than_the_cache_is_refused(runs) -> None:
    for rank in runs:
        assert rank["refused"].startswith(f"bench: context {S_MAX} + 1 rounds of up to {GAMMA + 1} tokens")
        assert f"must fit the cache's {S_MAX} positions per slot" in rank["refused"]
    assert METHODS["dustin-h"].sparse
