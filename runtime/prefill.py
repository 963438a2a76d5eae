"""Chunked prefill of ragged prompts into consecutive slots of a static cache.

A job's prompts start at the same position and advance together chunk by chunk (`PrefillJob`), so activation memory
is bounded by the chunk; a shorter prompt's padding writes K/V past its length, which nothing reads and decoding
overwrites (the attention backend skips padding rows it is told of: AttentionMetadata.query_lens). Jobs on
adjacent slots of one cache can run their next chunks in one forward (`step_together`, grouped by `group_jobs`),
each row at its own position: the in-flight batcher prefills several admissions that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer

__all__ = ["PrefillJob", "group_jobs", "prefill", "prefill_chunk_for", "slot_range", "step_together"]

# Rows one prefill forward takes at most over the whole batch: 8K tokens per sequence ran closer to the attention +
# GEMM bound than 2K on the H200 (benchmarks/dev/README.md); a 32K-row chunk's FFN activations take about 2 GB at
# Llama-3.1-8B's width.
CHUNK_ROWS = 32768
MAX_CHUNK = 8192
# Padded rows a batched prefill forward may carry beyond twice its real ones: a forward of this many rows costs
# about what one of a few rows does (launch-bound), so padding them costs nothing.
PAD_FREE_ROWS = 1024


def prefill_chunk_for(batch: int) -> int:
    """Prompt tokens per sequence per prefill forward for `batch` prompts: 8K, fewer past 4 sequences."""
    return max(512, min(MAX_CHUNK, CHUNK_ROWS // max(batch, 1)))


def slot_range(cache: KVCache, slots: slice) -> KVCache:
    """The cache restricted to the consecutive slots [start, stop) (views: writes land in the shared buffers)."""
    start, stop, step = slots.indices(cache.batch_slots)
    if step != 1 or stop <= start:
        raise ValueError(f"slots {slots} must be a non-empty run of consecutive batch slots")
    if (start, stop) == (0, cache.batch_slots):
        return cache
    return KVCache(cache.k[:, start:stop], cache.v[:, start:stop], cache.seqlens[start:stop])


class PrefillJob:
    """Prompts written into a cache's slots chunk by chunk: `step()` runs the next chunk, `run()` all of them.

    The in-flight batcher interleaves one job's chunks with the other slots' decode rounds. Between chunks the
    job's slots are parked at length done + 1 (done: prompt tokens written so far): a round writes the target's K/V
    at L_b .. L_b + Γ and a model drafter's at L_b - 1 .. L_b + Γ - 1, all at positions >= done, which the next chunk
    writes again before anything reads them; the prompt's finished part stays as the chunks wrote it.
    """

    @torch.inference_mode()
    def __init__(self, model: Transformer, cache: KVCache, backend: AttentionBackend,
                 prompts: Sequence[Sequence[int]], chunk: int = 2048, capture_layers: Sequence[int] = (),
                 hidden_out: dict[int, torch.Tensor] | None = None, start: int = 0, slots: slice | None = None,
                 window_layers: Sequence[int] = (), window_rows: int = 0) -> None:
        """slots: the consecutive slots of `cache` the prompts go to, one per prompt (None: 0 .. B-1).
        window_layers, window_rows: also keep those layers' hidden states of each prompt's last window_rows positions
        (`hidden_window`; the ring drafter's ring at admission)."""
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("prefill needs at least one prompt and no empty one")
        if chunk < 1:
            raise ValueError(f"prefill chunk {chunk} must be >= 1")
        if not 0 <= start < min(len(p) for p in prompts):
            raise ValueError(f"prefill start {start} must leave at least the last prompt token to run "
                             f"(0 <= start < {min(len(p) for p in prompts)})")
        B = len(prompts)
        if B > cache.batch_slots:
            raise ValueError(f"{B} prompts for {cache.batch_slots} cache slots")
        first, stop, step = (slots or slice(0, B)).indices(cache.batch_slots)
        if step != 1 or stop - first != B:
            raise ValueError(f"slots {slots} must be {B} consecutive slots of the cache's {cache.batch_slots}, one "
                             "per prompt")
        self.model, self.backend, self.chunk = model, backend, chunk
        self.cache, self.first_slot = cache, first  # the whole cache: step_together spans adjacent jobs' slots
        self.capture_layers, self.hidden_out = tuple(capture_layers), hidden_out or {}
        device, config = cache.seqlens.device, model.config
        self.lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
        self.longest = max(len(p) for p in prompts)
        self.tokens = torch.zeros(B, self.longest, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.view = slot_range(cache, slice(first, stop))
        # Prompt positions written so far (the same for every prompt: they advance together). start > 0: the caller
        # has put the prompts' first `start` positions into the cache already (a reused prefix: prefix_cache.py).
        self.done = start
        self.last_logits = torch.zeros(B, config.vocab_size, dtype=torch.float32, device=device)
        self.qdtype = model.embed.weight.dtype  # the model's: the cache may be fp8
        self.last_queries = {layer: torch.zeros(B, config.num_heads, config.head_dim, dtype=self.qdtype,
                                                device=device) for layer in self.capture_layers}
        self.view.seqlens.fill_(self.done + 1)  # parked until the first chunk
        if window_layers and window_rows < 1:
            raise ValueError(f"window_rows {window_rows} must be >= 1 to keep the hidden states of {window_layers}")
        # one row more than asked: the chunk's positions outside the window are written there (no host sync)
        self._window = {layer: torch.zeros(B, window_rows + 1, config.hidden_size, dtype=self.qdtype, device=device)
                        for layer in window_layers}

    @property
    def hidden_window(self) -> dict[int, torch.Tensor]:
        """layer -> [B, R, H]: the hidden states of each prompt's last R positions (row r: position length - R + r;
        zero where that position is below 0 or below `start`, which this prefill did not run)."""
        return {layer: w[:, :-1] for layer, w in self._window.items()}

    @property
    def finished(self) -> bool:
        return self.done >= self.longest

    @property
    def remaining(self) -> int:
        """Prompt positions (of the longest prompt) still to write."""
        return self.longest - self.done

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def next_chunk(self) -> int:
        """Positions the next step writes (of the longest prompt)."""
        return min(self.chunk, self.remaining)

    def step(self) -> bool:
        """Write the next chunk; return whether the prompts are complete (their seqlens then set to their lengths)."""
        return step_together([self])[0]

    def run(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every remaining chunk; the last tokens' logits [B, V] and captured queries {layer: [B, H_q, D]}."""
        while not self.finished:
            self.step()
        return self.last_logits, self.last_queries


def _position_limit(job: PrefillJob) -> int:
    """Positions a forward of this job's model may write: the cache's length and the model's rotary table."""
    return min(job.cache.max_seq_len, getattr(job.model, "max_positions", None) or job.cache.max_seq_len)


def group_jobs(jobs: Sequence[PrefillJob], max_rows: int = CHUNK_ROWS, free_rows: int = PAD_FREE_ROWS
               ) -> list[list[PrefillJob]]:
    """Split jobs into groups that `step_together` can run as one forward each, in slot order: a group's slots are
    one consecutive run, its padded rows (rows x longest next chunk) stay within max_rows (a single job always
    fits) and within twice its real rows unless they are at most free_rows, and its padding stays inside the cache
    and the model's positions."""
    groups: list[list[PrefillJob]] = []
    width = rows = real = 0  # the current group's longest next chunk, its rows and its real (unpadded) positions
    for job in sorted(jobs, key=lambda j: j.first_slot):
        t, mine = max(width, job.next_chunk), job.rows * job.next_chunk
        last = groups[-1][-1] if groups else None
        if last is not None and (last.cache is job.cache and last.model is job.model and last.backend is job.backend
                                 and job.first_slot == last.first_slot + last.rows
                                 and (rows + job.rows) * t <= min(max_rows, max(free_rows, 2 * (real + mine)))
                                 and all(j.done + t <= _position_limit(j) for j in (*groups[-1], job))):
            groups[-1].append(job)
            width, rows, real = t, rows + job.rows, real + mine
        else:
            groups.append([job])
            width, rows, real = job.next_chunk, job.rows, mine
    return groups


@torch.inference_mode()
def step_together(jobs: Sequence[PrefillJob]) -> list[bool]:
    """The next chunk of every job in one forward: jobs of one model, backend and cache on one run of consecutive
    slots (each job's slots right after the previous one's), each row at its own job's position, every row padded
    to the longest chunk (`group_jobs` makes such groups). Returns, per job, whether its prompts are complete."""
    if not jobs:
        raise ValueError("step_together needs at least one prefill job")
    first = jobs[0]
    model, backend, cache = first.model, first.backend, first.cache
    for prev, job in zip(jobs, jobs[1:], strict=False):
        if job.cache is not cache or job.model is not model or job.backend is not backend:
            raise ValueError("prefill jobs run together must share their model, backend and cache")
        if job.first_slot != prev.first_slot + prev.rows:
            raise ValueError(f"prefill jobs run together must sit on adjacent slots: slots from {prev.first_slot} "
                             f"({prev.rows}) then {job.first_slot}")
        if job.capture_layers != first.capture_layers or job.hidden_out.keys() != first.hidden_out.keys() or \
                job._window.keys() != first._window.keys():
            raise ValueError("prefill jobs run together must capture the same layers")
    if any(job.finished for job in jobs):
        raise RuntimeError("this prefill has no chunk left")
    T = max(job.next_chunk for job in jobs)
    over = [job.first_slot for job in jobs if job.done + T > _position_limit(job)]
    if over:
        raise ValueError(f"a {T}-token chunk padded from the jobs' positions would pass the cache or the model's "
                         f"positions at slots {over}; run those jobs alone")
    device, config = cache.seqlens.device, model.config
    starts = [job.done for job in jobs]
    ends = [job.done + job.next_chunk for job in jobs]
    rows = [job.rows for job in jobs]
    B = sum(rows)
    view = slot_range(cache, slice(first.first_slot, first.first_slot + B))
    # Per row, known on the host before the forward: its start, its chunk's end, and its length after the step
    # (-1: the job completes, its prompts take their own lengths; else parked at end + 1, PrefillJob's docstring).
    # One pinned copy: no host sync.
    table = torch.tensor([[s, e, -1 if e >= job.longest else e + 1]
                          for job, s, e in zip(jobs, starts, ends, strict=True) for _ in range(job.rows)],
                         dtype=torch.int32).T
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    start_rows, end_rows, after = table
    lens = torch.cat([job.lens for job in jobs])
    tokens = torch.cat([F.pad(job.tokens[:, s: s + T], (0, max(0, s + T - job.longest)))  # each chunk, padded to T
                        for job, s in zip(jobs, starts, strict=True)])
    view.seqlens.copy_(start_rows)
    real = torch.minimum((lens - start_rows).clamp_min(0), end_rows - start_rows).to(torch.int32)  # [B]: padded
    meta = AttentionMetadata(cache_seqlens=view.seqlens, max_kv_len=max(starts) + T, query_lens=real)
    in_chunk = torch.minimum((lens - 1 - start_rows).clamp_min(0), end_rows - start_rows - 1)  # each last token
    capture, qdtype = None, first.qdtype
    if first.capture_layers or first.hidden_out or first._window:
        capture = QueryCapture(first.capture_layers, {
            layer: torch.empty(B, T, config.num_heads, config.head_dim, dtype=qdtype, device=device)
            for layer in first.capture_layers},
            {layer: torch.empty(B, T, config.hidden_size, dtype=qdtype, device=device)
             for layer in {*first.hidden_out, *first._window}})
    logits = model(tokens, view, meta, backend, logit_index=in_chunk.long(), capture=capture)
    ends_here = ((lens - 1) >= start_rows) & ((lens - 1) < end_rows)  # [B]
    all_rows = torch.arange(B, device=device)
    row = 0
    for job, n, end in zip(jobs, rows, ends, strict=True):
        mine, here = slice(row, row + n), ends_here[row: row + n]
        job.last_logits = torch.where(here[:, None], logits[mine], job.last_logits)
        if capture is not None:
            picked = all_rows[mine], in_chunk[mine].long()
            for layer, q in capture.queries.items():
                job.last_queries[layer] = torch.where(here[:, None, None], q[picked], job.last_queries[layer])
            for layer in job.hidden_out:
                h = capture.hidden[layer]
                job.hidden_out[layer].copy_(torch.where(here[:, None], h[picked], job.hidden_out[layer]))
            if job._window:
                R = next(iter(job._window.values())).shape[1] - 1
                # chunk position j of row b is prompt position start + j: window row (start + j) - (length - R)
                at = start_rows[mine, None].long() + torch.arange(T, device=device) - (lens[mine, None].long() - R)
                at = torch.where((at >= 0) & (at < R), at, R)  # elsewhere: the spare row
                for layer, w in job._window.items():
                    w[torch.arange(n, device=device)[:, None], at] = capture.hidden[layer][mine]
        job.done = end
        row += n
    view.seqlens.copy_(torch.where(after < 0, lens, after))
    return [job.finished for job in jobs]


def prefill(model: Transformer, cache: KVCache, backend: AttentionBackend, prompts: Sequence[Sequence[int]],
            chunk: int = 2048, capture_layers: Sequence[int] = (), hidden_out: dict[int, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Write the prompts' K/V into the cache's slots 0 .. B-1 (pass a `slot_range` view for others), set their
    seqlens to the prompt lengths, return the last token's logits [B, V].

    For each layer in `capture_layers` also return the last prompt token's rotated queries [B, H_q, D]
    (Dustin's first target-history signal, paper Sec. 4.2.3). hidden_out: layer -> [B, H] buffers, filled with
    the last prompt token's hidden state (the block's output) at each of those layers (LongSpark's boundary state).
    """
    return PrefillJob(model, cache, backend, prompts, chunk, capture_layers, hidden_out).run()
