"""Pipeline faults end every rank in bounded time with one clear error: a rank killed mid-run, a rank that raises, a
rank that hangs (the process-group timeout), and ranks that disagree at start. The ranks are plain processes
(helpers.pipeline.launch), so nothing but the pipeline's own handling stops them."""

from __future__ import annotations

import os
import signal
import time
from itertools import count
from pathlib import Path

import pytest
from helpers.pipeline import CONFIGS, PROMPTS, launch, models, pipeline_decoder

from trtllm_dustin.plugins.kernel_config import KernelConfig

KILLED = 1  # the middle stage of three: its neighbours on both sides must notice, and the first stage through them
# The round ops' torch references, called directly: a custom op's first call costs each fresh rank a one-time import
# of seconds (torch._dynamo), and the methods here call no other.
REFERENCES = KernelConfig(round_kernels=False)


def _marker(payload: dict, rank: int) -> Path:
    return Path(payload["dir"], f"running{rank}")


def generate_until_stopped(group, payload, record) -> None:
    """Decode again and again (marking the first finished run), until a fault stops the pipeline."""
    target, draft = models()
    decoder = pipeline_decoder(group, "classic", 1, target, draft, kernels=REFERENCES)
    for run in range(10_000):
        decoder.generate(PROMPTS, CONFIGS["greedy"])
        if run == 0:
            _marker(payload, group.rank).touch()


def test_a_killed_rank_stops_the_others_with_an_error(tmp_path: Path) -> None:
    killed_at = []

    def kill_mid_run(procs) -> None:
        deadline = time.monotonic() + 120
        while not all(_marker({"dir": tmp_path}, r).exists() for r in range(3)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(procs[KILLED].pid, signal.SIGKILL)
        killed_at.append(time.time())

    records = launch(3, generate_until_stopped, {"dir": str(tmp_path), "timeout_s": 120}, tmp_path / "out",
                     on_start=kill_mid_run)
    assert killed_at, "the ranks never finished a first run"
    assert records[KILLED]["exitcode"] == -signal.SIGKILL
    for rank in (0, 2):
        record = records[rank]
        assert record["exitcode"] == 0 and record["error"].startswith("PipelineError: rank")
        assert "a peer died, was killed or stopped answering" in record["error"]
        # the closed connections, not the 120 s timeout, ended them: within seconds of the kill
        assert 0 < record["ended_at"] - killed_at[0] < 20


def start_then_fail(group, payload, record) -> None:
    """A start whose rank 1 disagrees (the handshake refuses it on every rank, and the group lives on), then a run
    in which one rank raises or hangs at its payload["at"]-th stage forward."""
    target, draft = models()
    try:
        pipeline_decoder(group, "classic", 1, target, draft, kernels=REFERENCES,
                         **({"gamma": 2} if group.rank == 1 else {}))
    except Exception as e:  # recorded: the test checks every rank's line
        record["refused"] = f"{type(e).__name__}: {e}"
    try:  # what generate --engine does with a rank's start error (say, another engine's pipeline size)
        group.handshake({}, "its engine was built for 2 stages" if group.rank == 2 else None)
    except Exception as e:
        record["could not start"] = f"{type(e).__name__}: {e}"
    decoder = pipeline_decoder(group, "classic", 1, target, draft, kernels=REFERENCES)
    if group.rank == payload["rank"]:
        forward, calls = decoder.stage.forward, count()

        def failing(*args, **kwargs):
            if next(calls) == payload["at"]:
                if payload["fault"] == "raise":
                    raise ValueError("injected fault")
                time.sleep(payload["sleep_s"])
            return forward(*args, **kwargs)

        decoder.stage.forward = failing
    decoder.generate(PROMPTS, CONFIGS["sampled"])


@pytest.fixture(scope="module")
def raised(tmp_path_factory) -> list[dict]:
    """Three ranks: refused at start twice (rank 1 disagrees; rank 2 failed to start), then rank 2 (the last stage)
    raises at its 6th forward, mid-decode."""
    return launch(3, start_then_fail, {"rank": 2, "at": 6, "fault": "raise", "timeout_s": 120},
                  tmp_path_factory.mktemp("raise"))


def test_ranks_started_differently_refuse_at_start(raised) -> None:
    """The handshake compares what each rank was started with (here rank 1's gamma) before anything is allocated,
    and a rank that could not start stops every rank with its reason (one line each)."""
    for record in raised:
        assert record["refused"] == ("PipelineError: rank 1 was started with gamma 2, rank 0 with 3; start every "
                                     "rank with the same command and engine")
        assert record["could not start"] == "PipelineError: rank 2 could not start: its engine was built for 2 stages"


def test_a_rank_that_raises_stops_the_others_naming_it(raised) -> None:
    """It leaves its error in the rendezvous store and closes its connections; the others stop at their next
    receive, at once, and name it."""
    assert raised[2]["error"] == "ValueError: injected fault"
    for rank in (0, 1):
        error = raised[rank]["error"]
        assert error.startswith(f"PipelineError: rank {rank}: the pipeline failed while waiting for")
        assert "rank 2 failed with ValueError: injected fault" in error
        assert raised[rank]["ended_at"] - raised[2]["ended_at"] < 20  # at once, not after the 120 s timeout


def test_a_rank_that_hangs_is_caught_by_the_timeout(tmp_path: Path) -> None:
    """Rank 1 sleeps 4 s in a forward; rank 0, waiting for it, stops on the 1 s timeout before rank 1 wakes, and
    rank 1 then finds it gone."""
    payload = {"rank": 1, "at": 4, "fault": "hang", "sleep_s": 4, "timeout_s": 1}
    records = launch(2, start_then_fail, payload, tmp_path)
    assert records[0]["error"].startswith("PipelineError: rank 0: the pipeline failed while waiting for")
    assert records[1]["ended_at"] - records[0]["ended_at"] > 1.5
    assert records[1]["error"].startswith("PipelineError: rank 1")
