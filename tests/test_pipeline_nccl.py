"""The pipeline on GPUs with NCCL (needs 2 CUDA devices; skipped elsewhere, e.g. in CI): greedy tokens equal the
single-process runtime's on one GPU, with CUDA graphs of the stage forwards and the drafter, one micro-batch and two;
PipelineDecoder.bench commits what the single-process rounds commit under the same stated acceptor; a killed rank
stops the other with a PipelineError within the group's timeout.

Both sides run the Triton kernels in float32 on the module path (fused elementwise off), where a stage chain is the
whole model bit for bit, so greedy tokens can be compared exactly."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.pipeline import BATCH, CONFIGS, DUSTIN, GAMMA, PROMPTS, S_MAX, Launch, launch, longspark, models

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.build import attention_backend, build_decoder
from trtllm_dustin.runtime.methods import MethodSetup

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

METHODS_RUN = ["vanilla", "classic", "magicdec", "dustin-h", "dustin-h-sparse-draft", "dustin-ip-sparse-draft"]
KERNELS = KernelConfig(fused_elementwise=False)


def _on(device: torch.device):
    target, draft = models()
    return target.to(device), draft.to(device)


def nccl_cases(group, payload, record) -> None:
    from helpers.pipeline import pipeline_decoder
    from stated_acceptance import StatedAcceptor, stated_acceptance

    target, draft = _on(group.device)
    record["result"], record["bench"] = {}, {}
    backend = attention_backend(group.device, KERNELS)
    for method in METHODS_RUN:
        for micro in (1, 2):
            decoder = pipeline_decoder(group, method, micro, target, draft, backend=backend, kernels=KERNELS,
                                       use_cuda_graph=True)
            record["result"][f"{method}/{micro}"] = decoder.generate(PROMPTS, CONFIGS["greedy"]).tokens
        decoder = pipeline_decoder(group, method, 1, target, draft, backend=backend, kernels=KERNELS,
                                   use_cuda_graph=True)
        acceptor = StatedAcceptor(stated_acceptance(2.6, GAMMA)[0].to(group.device), seed=3) \
            if group.last and decoder.gamma else None
        decoder.bench(60, 2, acceptor)  # the graphs are captured here
        out = decoder.bench(60, 6, acceptor)
        record["bench"][method] = {"committed": out.committed, "ms": out.ms}


def reference(method: str) -> list[list[int]]:
    device = torch.device("cuda", 0)
    target, draft = _on(device)
    decoder = build_decoder(method, MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, BATCH, S_MAX, torch.float32, device),
        backend=attention_backend(device, KERNELS), draft=draft,
        draft_cache=KVCache.allocate(draft.config, BATCH, S_MAX, torch.float32, device), gamma=GAMMA,
        draft_budget=12, dustin=DUSTIN, longspark=longspark(target), kernels=KERNELS, use_cuda_graph=True))
    return decoder.generate(PROMPTS, CONFIGS["greedy"]).tokens


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory) -> list[dict]:
    return Launch(2, nccl_cases, {"device": "cuda", "timeout_s": 120}, tmp_path_factory.mktemp("nccl")).join(600)


@pytest.mark.parametrize("method", METHODS_RUN)
def test_the_nccl_pipeline_equals_the_single_process_runtime(nccl_runs, method: str) -> None:
    assert all("error" not in r and r["exitcode"] == 0 for r in nccl_runs), [r.get("traceback") for r in nccl_runs]
    expected = reference(method)
    for record in nccl_runs:
        for micro in (1, 2):
            assert record["result"][f"{method}/{micro}"] == expected, (method, micro)
    first, last = (r["bench"][method] for r in nccl_runs)
    assert first["committed"] == last["committed"] >= BATCH * 7 and first["ms"] > 0


def run_until_killed(group, payload, record) -> None:
    from helpers.pipeline import pipeline_decoder

    target, draft = _on(group.device)
    decoder = pipeline_decoder(group, "classic", 1, target, draft, backend=attention_backend(group.device, KERNELS),
                               kernels=KERNELS)
    for run in range(10_000):
        decoder.generate(PROMPTS, CONFIGS["greedy"])
        if run == 0:
            Path(payload["dir"], f"running{group.rank}").touch()


def test_a_killed_rank_stops_the_other_on_nccl(tmp_path: Path) -> None:
    killed_at = []

    def kill(procs) -> None:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"running{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at.append(time.time())

    records = launch(2, run_until_killed, {"dir": str(tmp_path), "device": "cuda", "timeout_s": 60},
                     tmp_path / "out", on_start=kill)
    assert killed_at, "the ranks never finished a first run"
    assert records[1]["exitcode"] == -signal.SIGKILL
    assert records[0]["error"].startswith("PipelineError: rank 0: the pipeline failed while waiting for")
    assert 0 < records[0]["ended_at"] - killed_at[0] < 90  # within the 60 s timeout and its teardown
