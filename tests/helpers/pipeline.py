"""What the pipeline tests share (test_pipeline.py, test_pipeline_faults.py, test_pipeline_engine.py): tiny-llama and
its draft, the prompts, the Dustin config and generation configs, a pipeline decoder on one rank, and the launching of
ranks as plain processes given torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that nothing but
the pipeline's own fault handling stops them."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trtllm_dustin.attention import get_backend
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.models.loading import _random_init
from trtllm_dustin.models.longspark import LongSpark, random_longspark
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.pipeline import PipelineStage
from trtllm_dustin.runtime.sampling import SamplingParams

__all__ = ["BATCH", "CONFIGS", "DTYPE", "DUSTIN", "GAMMA", "PROMPTS", "S_MAX", "Launch", "free_port", "launch",
           "longspark", "models", "pipeline_decoder", "rank_env"]

DTYPE = torch.float32
GAMMA, S_MAX, BATCH = 3, 112, 4
PROMPTS = [list(range(5, 5 + 60)), [9, 8, 7], list(range(100, 100 + 41)), [200 + i % 13 for i in range(47)]]
# SRH target layers 1 and 2: on ranks 0 and 1 of 2 stages ([0, 2), [2, 3)), on ranks 1 and 2 of 3, so that S_target is
# summed across stages and, with 3, the first stage owns none. k = 28 of up to 80 positions: the set really restricts.
# The in-pass selection layer 1 is the first stage's of 2 and the middle one's of 3.
DUSTIN = DustinConfig(target_layers=(LayerHeads(1, (0, 4)), LayerHeads(2, (1,))),
                      draft_layers=(LayerHeads(0, (1,)), LayerHeads(1, (2, 3))), budget=28, m=4, n_sink=4,
                      n_recent=8, gamma=GAMMA, selection_layers=(LayerHeads(1, tuple(range(6))),))
CONFIGS = {"greedy": GenerationConfig(max_new_tokens=12, prefill_chunk=32),
           "sampled": GenerationConfig(max_new_tokens=12, prefill_chunk=32, sampling=SamplingParams(0.9, 0.9, seed=5))}


def models() -> tuple[Transformer, Transformer]:
    """tiny-llama and its draft with load_model's random weights (seeds 7 and 8), built on the CPU directly:
    load_model's meta-device path costs every fresh rank process a one-time import of seconds."""
    target, draft = Transformer(get_preset("tiny-llama")), Transformer(get_preset("tiny-llama-draft"))
    _random_init(target, seed=7)
    _random_init(draft, seed=8)
    return target.to(DTYPE).eval(), draft.to(DTYPE).eval()


def longspark(target: Transformer) -> LongSpark:
    """A random LongSpark drafter on tiny-llama, reading its layers 1 and 2 (on ranks 0 and 1 of 2 stages, 1 and 2 of
    3), with a window of 24 rows, shorter than the prompts: its summaries and windows both count."""
    return random_longspark(target, seed=3, window=24)


# ---- launching ranks -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's contract for one rank (what env:// reads), and the plugins' CPU references."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}


def _rank_main(rank: int, world: int, port: int, out: str, job: Callable, payload) -> None:
    """One rank: join the group, run job(group, payload, record), which fills the record; write it to rank<r>.json
    with the error, if any, that ended the rank."""
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    from trtllm_dustin.runtime.pipeline import PipelineGroup

    record = {}
    try:
        with PipelineGroup.from_env(payload.get("device", "cpu"), timeout_s=payload.get("timeout_s", 60)) as group:
            job(group, payload, record)
    except BaseException as e:  # recorded for the parent, which checks every rank's outcome
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
    record["ended_at"] = time.time()  # the host's clock: comparable across the ranks and the parent
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


class Launch:
    """`job` on `world` fresh processes, started at once; `join()` gives each rank's record (with `ended_at`, when it
    stopped, if it did not die) and its exit code."""

    def __init__(self, world: int, job: Callable, payload: dict, out: Path) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.start = out, time.monotonic()
        self.procs = [ctx.Process(target=_rank_main, args=(rank, world, port, str(out), job, payload))
                      for rank in range(world)]
        # A spawned rank imports this module, and with it the plugins, before _rank_main runs: it must inherit
        # TRITON_INTERPRET=0 (the plugins read it once, at import) to take the CPU references.
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TRITON_INTERPRET", "0")
            for p in self.procs:
                p.start()

    def join(self, wait_s: float = 240.0) -> list[dict]:
        for p in self.procs:
            p.join(max(1.0, wait_s - (time.monotonic() - self.start)))
        for p in self.procs:
            if p.is_alive():  # a hang: the test fails on its record, and leaves no process behind
                p.kill()
                p.join()
        records = []
        for rank, p in enumerate(self.procs):
            file = self.out / f"rank{rank}.json"
            record = json.loads(file.read_text()) if file.is_file() else {}
            records.append(record | {"exitcode": p.exitcode})
        return records


def launch(world: int, job: Callable, payload: dict, out: Path, on_start: Callable[[list], None] | None = None
           ) -> list[dict]:
    """Launch and join; on_start(processes) runs in between."""
    ranks = Launch(world, job, payload, out)
    if on_start is not None:
        on_start(ranks.procs)
    return ranks.join()


def pipeline_decoder(group, method: str, micro_batches: int, target, draft, **changes):
    from trtllm_dustin.runtime.pipeline import PipelineDecoder, PipelineSetup, layer_split

    split = changes.get("layers") or layer_split(target.config.num_layers, group.world)
    start, stop = split[group.rank]
    from trtllm_dustin.runtime.methods import METHODS

    stage = PipelineStage.from_model(target, start, stop, group.rank, group.world)
    spark = longspark(target) if METHODS[method].needs_longspark else None
    setup = PipelineSetup(method, stage, group, get_backend("reference"), BATCH, S_MAX, draft_config=draft.config,
                          draft=draft if group.first else None, gamma=GAMMA, draft_budget=12, dustin=DUSTIN,
                          micro_batches=micro_batches, longspark_config=spark.config if spark is not None else None,
                          longspark=spark if group.first else None, layers=changes.pop("layers", None))
    return PipelineDecoder(replace(setup, **changes))
