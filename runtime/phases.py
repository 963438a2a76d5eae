"""The phases of one round, as functions of the tensors they read and write.

    first_tokens -> begin           a slot starts: its first token from the prefill logits
    propose (Drafter) -> choose     the drafts, then the round's verification set (estimate -> select)
    verify (the target's forward)   logits [B, Γ+1, V], masked to the pair's shared vocabulary (mask_shared)
    accept -> observe_and_commit    the verdict; the drafter and selector read it, then the commit moves the state on
    FinishCheck                     whether every sequence has finished, asked once per round

`Decoder.round` (decoder.py) runs them in order in one process; the pipeline's stages (pipeline/decoder.py) run the
same functions and only move tensors between ranks in between; `generate()` and the in-flight batcher start slots
with `first_tokens` and `begin`. None of them syncs with the device except FinishCheck, at its stated points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from trtllm_dustin.plugins.commit import commit_round
from trtllm_dustin.runtime.acceptor import Acceptor, Verdict
from trtllm_dustin.runtime.acceptors import GreedyAcceptor, RejectionAcceptor
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.selector import Selector
from trtllm_dustin.runtime.state import Observation, Progress, RoundState

__all__ = ["Acceptors", "FinishCheck", "accept", "begin", "choose", "first_tokens", "mask_shared",
           "observe_and_commit", "warm_up_commit"]


# ---- a slot starts --------------------------------------------------------------------------------------------
def first_tokens(logits: torch.Tensor, sampling: SamplingParams | Sequence[SamplingParams], use_kernel: bool
                 ) -> torch.Tensor:
    """Each prompt's first token [n] from its prefill logits [n, V], drawn with seed + 1 (the rounds draw with seed):
    one generator for the batch when `sampling` is one SamplingParams (generate()), one per row, each with its own
    seed, when it is a sequence of them (a served request; the pipeline's per-slot sampling)."""
    if isinstance(sampling, SamplingParams):
        return SlotSampling.batch(sampling, logits.shape[0], logits.device, seed=sampling.seed + 1,
                                  use_kernel=use_kernel).pick(logits)
    if len(sampling) != logits.shape[0]:
        raise ValueError(f"{len(sampling)} sampling parameters for {logits.shape[0]} prompts")
    return torch.cat([SlotSampling.batch(p, 1, logits.device, seed=p.seed + 1, use_kernel=use_kernel)
                      .pick(logits[i: i + 1]) for i, p in enumerate(sampling)])


def begin(state: RoundState, progress: Progress, slots: slice, first: torch.Tensor,
          prompts: Sequence[Sequence[int]], limits: int | Sequence[int]) -> None:
    """Slots start generating: `first` [n] is each one's first token, the prompts' last tokens the previous ones."""
    state.cur[slots] = first
    state.prev[slots] = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=first.device)
    progress.begin(slots, first, limits)


# ---- select, verify, accept ------------------------------------------------------------------------------------
def _eager(name: str, fn: Callable[[], Any]) -> Any:
    return fn()


def choose(selector: Selector, lengths: torch.Tensor, phase: Callable[[str], contextlib.AbstractContextManager]
           | None = None, run: Callable[[str, Callable[[], Any]], Any] = _eager,
           combine: Callable[[Any], Any] | None = None) -> torch.Tensor | None:
    """The estimate and select phases: the round's verification set, or None when the selector verifies in full
    (no phase runs). phase: a PhaseTimer (None: untimed); run(name, fn): how a phase runs (PhaseGraphs.run replays
    a CUDA graph; default: eagerly); combine: rewrites the estimate's scores before the selection (the pipeline's
    first stage puts in the S_target that the SRH stages sent)."""
    if selector.budget is None:
        return None
    phase = phase or (lambda name: contextlib.nullcontext())
    scores = None
    if selector.estimates():  # else no phase: an empty one would be an empty CUDA graph replayed every round
        with phase("estimate"):
            scores = run("estimate", lambda: selector.estimate(lengths))
    if combine is not None:
        scores = combine(scores)
    with phase("select"):
        return run("select", lambda: selector.select(lengths, scores))


def mask_shared(logits: torch.Tensor, shared_vocab: int) -> torch.Tensor:
    """The target's logits with ids outside the pair's shared vocabulary masked out (in place). Pairs may pad their
    embedding tables differently around one tokenizer (Qwen2.5-0.5B: 151936 rows, 7B: 152064); the target only ever
    proposes ids that every real token is in."""
    if shared_vocab < logits.shape[-1]:
        logits[..., shared_vocab:] = float("-inf")
    return logits


class Acceptors:
    """The two acceptors a round picks from: greedy when every slot is greedy, rejection sampling otherwise."""

    def __init__(self, use_kernel: bool) -> None:
        self.greedy = GreedyAcceptor(use_kernel)
        self.rejection = RejectionAcceptor(use_kernel)

    def pick(self, sampling: SlotSampling | None) -> Acceptor:
        return self.greedy if sampling is None or sampling.all_greedy else self.rejection


def accept(acceptors: Acceptors, proposal: Proposal, logits: torch.Tensor, progress: Progress,
           sampling: SlotSampling | None, acceptor: Acceptor | None = None) -> Verdict:
    """The verdict of the round's logits [B, Γ+1, V] on the proposal; acceptor None: `acceptors.pick(sampling)`."""
    return (acceptor or acceptors.pick(sampling)).accept(proposal, logits, progress, sampling)


# ---- observe and commit ----------------------------------------------------------------------------------------
def observe_and_commit(tokens: torch.Tensor, verdict: Verdict, progress: Progress, state: RoundState,
                       indices: torch.Tensor | None, queries: dict[int, torch.Tensor],
                       hidden: dict[int, torch.Tensor], observers: Iterable[Any], use_kernel: bool) -> None:
    """Every observer (the drafter, the selector, a stage's target history) reads the verdict before the commit
    moves the state on; then the commit appends the accepted drafts and the target's token, cut at EOS and each
    slot's limit. tokens: int64 [B, Γ+1], the round's verified tokens (the last committed one, then the drafts).
    In place; one launch on the GPU (the captured phases read prev, cur and the lengths)."""
    seen = Observation(verdict.accepted, verdict.next_tokens, progress.active, state.lengths, indices, queries,
                       hidden)
    for observer in observers:
        observer.observe(seen)
    commit_round(tokens[:, 1:], tokens, verdict.accepted, verdict.next_tokens, progress.eos, progress.limits,
                 progress.out, progress.active, progress.generated, progress.hist, state.prev, state.cur,
                 state.lengths, use_kernel=use_kernel)


def warm_up_commit(tokens: torch.Tensor, verdict: Verdict, progress: Progress, state: RoundState, use_kernel: bool
                   ) -> None:
    """The commit once on copies of the Progress and the state, before the decode clock starts: its first launch in
    a process pays a one-time compile (and, on the CPU host, importing torch._dynamo, about 3 s) that would
    otherwise land in the first timed round. Nothing the run reads is written."""
    scratch = replace(progress, **{f.name: getattr(progress, f.name).clone() for f in fields(progress)})
    copy = RoundState(lengths=state.lengths.clone(), cur=state.cur.clone(), prev=state.prev.clone())
    observe_and_commit(tokens.clone(), verdict, scratch, copy, None, {}, {}, (), use_kernel)


# ---- the stop rule ---------------------------------------------------------------------------------------------
class FinishCheck:
    """Whether every sequence has finished after a round, asked once per round without stalling the device.

    On the CPU the round's ops have already run when the host asks, so reading the flag costs nothing: the loop stops
    right after the last decoding round. On the GPU the host runs ahead of the device: each round's flag is copied
    asynchronously into pinned host memory behind an event, and with `poll` the loop stops at the first round whose
    copy has landed saying "all finished" (polled with `Event.query()`, which never waits); every `sync_every` rounds
    the host waits for the newest flag, and with `run_ahead` > 0 it waits for the flag of the round `run_ahead` back
    before it queues another (an event the device passed with `run_ahead` rounds still queued: it does not idle the
    device), so at most `run_ahead` idle rounds follow the last decoding one.

    poll=False (the pipeline's stages) answers only from the blocking reads, every `sync_every` rounds: every rank
    then stops after the same round, whatever each one's device timing."""

    def __init__(self, device: torch.device, sync_every: int, run_ahead: int = 0, poll: bool = True) -> None:
        self.cuda, self.sync_every = device.type == "cuda", sync_every
        self.run_ahead, self.poll = (run_ahead, True) if poll else (0, False)
        if self.cuda:
            self.ring = max(sync_every, self.run_ahead + 1)  # flags in flight at once never exceed either bound
            self.flags = torch.ones(self.ring, dtype=torch.bool, pin_memory=True)  # [r % ring]: any active
            self.events = [torch.cuda.Event() for _ in range(self.ring)]
            self.pending: list[int] = []  # ring slots whose copy was queued and not read yet, oldest first

    def __call__(self, active: torch.Tensor, rounds: int) -> bool:
        if not self.cuda:
            return not bool(active.any())  # a CPU tensor: a host read, not a device sync
        if not self.poll:
            return rounds % self.sync_every == 0 and not bool(active.any())  # the one blocking read
        slot = rounds % self.ring
        self.flags[slot].copy_(active.any(), non_blocking=True)
        self.events[slot].record()
        self.pending.append(slot)
        if rounds % self.sync_every == 0:
            self.events[slot].synchronize()  # every sync_every rounds: a blocking read of the newest flag
        elif self.run_ahead and len(self.pending) > self.run_ahead:
            self.events[self.pending[0]].synchronize()  # the flag of the round run_ahead back
        while self.pending and self.events[self.pending[0]].query():
            if not bool(self.flags[self.pending.pop(0)]):  # landed in host memory: reading it does not sync
                return True
        return False
