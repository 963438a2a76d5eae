"""Several prefill jobs in one forward (runtime/prefill.py: step_together, group_jobs): prompts on adjacent slots,
each at its own position (a reused prefix), with ragged last chunks, write the same K/V and give the same logits,
captured queries and hidden states as each job run alone; the grouping keeps to adjacent slots, the row limit, the
padding limit and the cache's end; the in-flight batcher runs a burst of admissions in a few forwards."""

from __future__ import annotations

import pytest
import torch

from trtllm_dustin.attention import get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.prefill import PrefillJob, group_jobs, step_together

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_LEN = 80
CHUNK = 16
CAPTURE = (1,)


def _model(dtype: torch.dtype):
    return load_model("preset:tiny-llama", dtype=dtype, seed=3, device=DEVICE).model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 250, (n,), generator=g).tolist() for n in (37, 50, 20, 33)]


# (slots, prompt indices, start): slot 1's prompt starts after a reused 16-token prefix; slots 2-3 are one job of two
JOBS = [(slice(0, 1), [0], 0), (slice(1, 2), [1], 16), (slice(2, 4), [2, 3], 0)]


def _job(model, cache, backend, prompts, slots, start):
    hidden = {0: torch.zeros(len(prompts), model.config.hidden_size, dtype=model.embed.weight.dtype, device=DEVICE)}
    return PrefillJob(model, cache, backend, prompts, CHUNK, CAPTURE, hidden_out=hidden, start=start, slots=slots)


# On CUDA the fp64 reference differs at the 1e-7 level, in the chunk whose forward spans a longer key range than the
# job's own (a group reads up to its furthest row): 4.5e-7 at most on the H200
# (benchmarks/results/serving_h200_batched/diag_batched_prefill.py); on the CPU it is exact to rounding.
FP64_TOL = 1e-5 if DEVICE == "cuda" else 1e-10


@pytest.mark.parametrize("backend_name,dtype,tol",
                         [("reference", torch.float64, FP64_TOL), ("triton", torch.float32, 2e-4)])
def test_jobs_run_together_equal_each_job_run_alone(backend_name: str, dtype: torch.dtype, tol: float) -> None:
    model, backend, prompts = _model(dtype), get_backend(backend_name), _prompts()
    alone = KVCache.allocate(model.config, 4, MAX_LEN, dtype, DEVICE)
    solo = []
    for slots, which, _ in JOBS:  # each job alone, from position 0
        job = _job(model, alone, backend, [prompts[i] for i in which], slots, 0)
        job.run()
        solo.append(job)
    together = KVCache.allocate(model.config, 4, MAX_LEN, dtype, DEVICE)
    together.k[:, 1, :, :16], together.v[:, 1, :, :16] = alone.k[:, 1, :, :16], alone.v[:, 1, :, :16]  # the prefix
    jobs = [_job(model, together, backend, [prompts[i] for i in which], slots, start) for slots, which, start in JOBS]
    forwards = 0
    while not all(j.finished for j in jobs):
        waiting = [j for j in jobs if not j.finished]
        assert len(group_jobs(waiting)) == 1  # adjacent slots, equal or nearly equal chunks: one forward
        step_together(waiting)
        forwards += 1
    assert forwards == 3  # chunks 16, 16, 5 (slot 0), 16, 16, 2 (slot 1 from 16), 16, 16, 1 (slots 2-3)
    lens = [len(p) for p in prompts]
    assert together.seqlens.tolist() == alone.seqlens.tolist() == lens
    for b, n in enumerate(lens):
        for name in ("k", "v"):
            a, t = getattr(alone, name)[:, b, :, :n], getattr(together, name)[:, b, :, :n]
            assert torch.allclose(t, a, atol=tol, rtol=tol), (name, b)
    for s, j in zip(solo, jobs, strict=True):
        assert torch.allclose(j.last_logits, s.last_logits, atol=tol, rtol=tol)
        assert torch.allclose(j.last_queries[1], s.last_queries[1], atol=tol, rtol=tol)
        assert torch.allclose(j.hidden_out[0], s.hidden_out[0], atol=tol, rtol=tol)


def _jobs_at(specs, max_len: int = MAX_LEN) -> list[PrefillJob]:
    """Prefill jobs of one prompt each on one cache: specs (slot, prompt length, start)."""
    model, backend = _model(torch.float32), get_backend("reference")
    cache = KVCache.allocate(model.config, 8, max_len, torch.float32, DEVICE)
    return [PrefillJob(model, cache, backend, [[5] * n], CHUNK, start=start, slots=slice(slot, slot + 1))
            for slot, n, start in specs]


def _slots(groups) -> list[list[int]]:
    return [[j.first_slot for j in g] for g in groups]


def test_groups_are_runs_of_adjacent_slots_within_the_row_and_padding_limits() -> None:
    jobs = _jobs_at([(5, 40, 0), (0, 40, 0), (1, 40, 0), (2, 40, 0), (6, 40, 0)])
    assert _slots(group_jobs(jobs)) == [[0, 1, 2], [5, 6]]  # slot order; 3 and 4 are not prefilling
    assert _slots(group_jobs(jobs, max_rows=2 * CHUNK)) == [[0, 1], [2], [5, 6]]  # at most 32 padded rows
    assert _slots(group_jobs(jobs, max_rows=1)) == [[0], [1], [2], [5], [6]]  # a job alone always runs
    # Next chunks 16 and 1 (a 1-token prompt): 32 padded rows for 17 real ones is within twice; 16, 1, 1 is not
    ragged = _jobs_at([(0, 40, 0), (1, 1, 0), (2, 1, 0)])
    assert _slots(group_jobs(ragged)) == [[0, 1, 2]]  # 48 padded rows: launch-bound anyway (free_rows)
    assert _slots(group_jobs(ragged, free_rows=0)) == [[0, 1], [2]]
    # Padding past the cache's end: slot 0's next 16-token chunk would write 70 .. 85 of an 80-position cache
    near_end = _jobs_at([(0, 75, 70), (1, 40, 0)])
    assert [j.next_chunk for j in near_end] == [5, 16]
    assert _slots(group_jobs(near_end)) == [[0], [1]]
    with pytest.raises(ValueError, match="would pass the cache or the model's positions at slots \\[0\\]"):
        step_together(near_end)


def test_step_together_refuses_jobs_it_cannot_run_in_one_forward() -> None:
    jobs = _jobs_at([(0, 20, 0), (2, 20, 0)])
    with pytest.raises(ValueError, match="adjacent slots: slots from 0 \\(1\\) then 2"):
        step_together(jobs)
    other = _jobs_at([(1, 20, 0)])  # another cache
    with pytest.raises(ValueError, match="share their model, backend and cache"):
        step_together([jobs[0], other[0]])
    with pytest.raises(ValueError, match="at least one prefill job"):
        step_together([])
    with pytest.raises(ValueError, match="must be 2 consecutive slots"):
        PrefillJob(jobs[0].model, jobs[0].cache, jobs[0].backend, [[5] * 4, [5] * 4], CHUNK, slots=slice(0, 1))


def test_the_hidden_window_holds_each_prompts_last_positions() -> None:
    """window_layers / window_rows: each prompt's last R positions' hidden states, equal to the whole-sequence
    forward's, whether the window spans several chunks, prompts of one job differ in length, a prompt is shorter
    than R (its first rows stay zero) or jobs run together; a reused prefix's positions (not run) stay zero too."""
    model, backend, prompts = _model(torch.float64), get_backend("reference"), _prompts()
    from trtllm_dustin.models.decoder import QueryCapture

    R, layers = 24, (0, 2)
    cache = KVCache.allocate(model.config, 4, MAX_LEN, torch.float64, DEVICE)
    PrefillJob(model, cache, backend, [prompts[1][:16]], CHUNK, slots=slice(1, 2)).run()  # slot 1's reused prefix
    jobs = [PrefillJob(model, cache, backend, [prompts[i] for i in which], 7, window_layers=layers, window_rows=R,
                       slots=slots, start=start) for slots, which, start in JOBS]
    while not all(j.finished for j in jobs):
        step_together([j for j in jobs if not j.finished])
    for (_, which, start), job in zip(JOBS, jobs, strict=True):
        for row, i in enumerate(which):
            n = len(prompts[i])
            tokens = torch.tensor([prompts[i]], device=DEVICE)
            capture = QueryCapture((), {}, {layer: torch.empty(1, n, model.config.hidden_size, dtype=torch.float64,
                                                               device=DEVICE) for layer in layers})
            model.run_whole(tokens, capture)
            for layer in layers:
                got = job.hidden_window[layer][row]
                positions = torch.arange(n - R, n)
                ran = positions >= start
                want = capture.hidden[layer][0, positions.clamp(min=0)]
                torch.testing.assert_close(got[ran], want[ran])
                assert (got[~ran] == 0).all() and ran.sum() == min(R, n - start)
