"""In-flight batching: requests join and leave a Decoder's batch slots between rounds.

    admit(request) -> slot     take a free slot; without a budget a prompt of at most `prefill_chunk` tokens (after
                               the prefix the prefix cache gives, if any) is prefilled at once (its first token comes
                               back); a longer one, and every one under a budget, chunk by chunk inside the next steps
    step()                     prefill chunks of the admitted prompts, oldest first, up to `prefill_budget` tokens
                               (the chunks of admissions on adjacent slots in one forward), then one Decoder.round
                               for every slot; a prompt whose last chunk ran begins and streams its first token
    release(slot)              the slot runs along idle until the next admission

Chunked admission under a token budget: a long prompt costs the running requests at most `prefill_budget` prompt
tokens of prefill per step, not its whole prefill, so none of them stalls for longer than that (time to first token
of the others and inter-token latency stay bounded); a larger budget admits queued prompts sooner at the cost of
the running requests' inter-token latency. Chunks of several admissions run as one ragged forward when their slots
are adjacent (a burst of admissions takes consecutive free slots), so a budget of many chunks costs a few forwards
rather than one per chunk (runtime/prefill.py: group_jobs). The admitted slots wait parked between their chunks
(runtime/prefill.py), outside the round's commits. With a PrefixCache, a prompt that starts with a cached prefix
copies its K/V into the slot and prefills only the rest (runtime/prefix_cache.py).

The round is the decoder's own, the one `generate()` runs. Every slot carries its own sampling parameters, token
limit and random generator (per-slot SlotSampling), so a request's tokens are those of `decoder.generate([prompt])`
on a single-slot decoder with the same seed, whatever else shares the batch.

One host sync per step (`step` reads back the tokens each slot committed, for streaming and admission).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtllm_dustin.runtime import phases
from trtllm_dustin.runtime.decoder import Decoder, SlotPrefill
from trtllm_dustin.runtime.generation import check_request
from trtllm_dustin.runtime.phase_timer import PhaseTimer
from trtllm_dustin.runtime.prefix_cache import PrefixCache
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["InflightBatcher", "SlotRequest", "SlotUpdate"]


@dataclass(frozen=True)
class SlotRequest:
    """One sequence to generate: its prompt ids, its own token limit and its own sampling."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass
class SlotUpdate:
    """What one slot committed in one step."""

    slot: int
    tokens: list[int]  # newly committed ids, in order (EOS included when emitted)
    finished: bool  # EOS or the slot's own token limit reached; release the slot
    accepted: int = 0  # draft tokens accepted this round (speculative methods)
    first: bool = False  # the request's first token (from its prefill): its time to first token


@dataclass
class _Slot:
    request: SlotRequest
    generator: torch.Generator | None  # this request's round randomness (seed), None when greedy
    prefill: SlotPrefill | None = None  # the prompt's chunks still to write (None: the slot is decoding)
    order: int = 0  # admission number


class InflightBatcher:
    def __init__(self, decoder: Decoder, eos_token_ids: tuple[int, ...] | list[int] = (), prefill_chunk: int = 2048,
                 prefill_budget: int | None = None, prefix_cache: PrefixCache | None = None) -> None:
        """prefill_budget: prompt tokens prefilled per step at most, over the waiting admissions oldest first, in
        chunks of at most prefill_chunk (at least one chunk runs); every prompt is then prefilled by step(), none at
        its admission, so a burst of admissions shares forwards. None: one chunk's worth of tokens per step, and
        every prompt of at most one chunk is prefilled at its admission, alone (the budget does not apply there).
        prefix_cache: reuse the K/V of cached prompt prefixes (runtime/prefix_cache.py); None: every prompt is
        prefilled whole."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1 token")
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"prefill_budget={prefill_budget} must be >= 1 token (or None: one chunk per step)")
        self.decoder = decoder
        self.cache = decoder.cache
        self.device = decoder.device
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_chunk if prefill_budget is None else prefill_budget
        self._deferred = prefill_budget is not None  # every prompt is prefilled by step(), under the budget
        self.prefix_cache = prefix_cache
        slots = self.cache.batch_slots
        self._slots: list[_Slot | None] = [None] * slots
        self.progress = Progress.allocate(slots, self.cache.max_seq_len, decoder.gamma, eos_token_ids, self.device)
        self._sampling: SlotSampling | None = None  # rebuilt when a slot begins or is released
        self._admitted = 0  # admissions so far: chunked prefills run oldest first
        with torch.inference_mode():
            decoder.state.idle(slice(None))

    @property
    def gamma(self) -> int:
        return self.decoder.gamma

    @property
    def batch_slots(self) -> int:
        return len(self._slots)

    @property
    def free_slots(self) -> int:
        return sum(s is None for s in self._slots)

    @property
    def busy(self) -> bool:
        return any(s is not None for s in self._slots)

    @property
    def prefilling(self) -> list[int]:
        """Slots admitted whose prompts are still being written, in admission order."""
        return sorted((i for i, s in enumerate(self._slots) if s is not None and s.prefill is not None),
                      key=lambda i: self._slots[i].order)

    def check(self, request: SlotRequest) -> None:
        """Raise ValueError (with the limit and the fix) when the request can never run in these caches."""
        check_request([request.prompt], self.cache, request.max_new_tokens, lookahead=self.gamma)

    @torch.inference_mode()
    def admit(self, request: SlotRequest) -> tuple[int, SlotUpdate | None]:
        """Take a free slot for the request. Without a prefill budget a prompt of at most `prefill_chunk` tokens is
        prefilled now and its first token returned; a longer one, and every one under a budget, returns None and is
        prefilled by the next `step()`s, whose update then carries its first token (`SlotUpdate.first`)."""
        self.check(request)
        if None not in self._slots:
            raise RuntimeError("no free batch slot; admit only when free_slots > 0")
        slot = self._slots.index(None)
        # a drafter that reads the hidden states of the prompt's last window_rows positions (the ring drafter) gets
        # them computed: the reused blocks end before them, so its state is the cold prefill's
        keys = self.prefix_cache.match(request.prompt, self.decoder.drafter.window_rows) \
            if self.prefix_cache is not None else []
        start = len(keys) * self.prefix_cache.block if keys else 0
        job = self.decoder.start_prefill(slice(slot, slot + 1), [list(request.prompt)], self.prefill_chunk, start)
        if keys:
            self.prefix_cache.load(keys, job.caches)
        generator = None if request.sampling.greedy else \
            torch.Generator(device=self.device).manual_seed(request.sampling.seed)
        self._admitted += 1
        self._slots[slot] = _Slot(request, generator, job, self._admitted)
        if self._deferred or job.remaining > self.prefill_chunk:
            return slot, None  # prefilled by the next steps, oldest first, batched with the other admissions
        job.step()
        return slot, self._begin(slot)

    def _begin(self, slot: int) -> SlotUpdate:
        """A slot whose prefill finished starts generating: its first token from the prefill logits."""
        entry = self._slots[slot]
        request, logits = entry.request, entry.prefill.logits  # [1, V]
        if self.prefix_cache is not None:  # the caches hold exactly the prompt now (no round has run on the slot)
            self.prefix_cache.store(request.prompt, entry.prefill.caches)
        entry.prefill = None
        # As generate(): the first token from seed + 1, the rounds from seed.
        first = phases.first_tokens(logits, [request.sampling], self.decoder.kernels.round_kernels)
        slots = slice(slot, slot + 1)
        self.decoder.begin(self.progress, slots, first, [list(request.prompt)], request.max_new_tokens)
        self._sampling = None
        # The one host sync of a slot's start: its first token is streamed now (time to first token).
        token, active = int(first[0]), bool(self.progress.active[slot])
        return SlotUpdate(slot, [token], finished=not active, first=True)

    def release(self, slot: int) -> None:
        """Free a slot (finished, cancelled, or still prefilling); it runs along idle until the next admission."""
        if self._slots[slot] is None:
            raise ValueError(f"slot {slot} is not in use")
        self._slots[slot] = None
        self._sampling = None
        self.decoder.release(self.progress, slot)

    def _slot_sampling(self) -> SlotSampling:
        if self._sampling is None:
            decoding = [s if s is not None and s.prefill is None else None for s in self._slots]
            self._sampling = SlotSampling([s.request.sampling if s else None for s in decoding],
                                          [s.generator if s else None for s in decoding], self.device,
                                          self.decoder.kernels.round_kernels)
        return self._sampling

    @torch.inference_mode()
    def step(self, timer: PhaseTimer | None = None) -> list[SlotUpdate]:
        """Prefill chunks of the chunked admissions, oldest first, up to prefill_budget tokens (at least one chunk),
        then one round for every decoding slot; return the first token of each slot whose prefill completed and what
        each decoding slot committed. timer: times the round's phases (the serving metrics)."""
        updates = []
        plan = self._plan()  # (slot, chunks this step), oldest admission first
        for wave in range(max((n for _, n in plan), default=0)):
            # The wave-th chunk of every planned prefill: admissions on adjacent slots share one forward.
            SlotPrefill.step_together([self._slots[slot].prefill for slot, n in plan if n > wave])
        for slot, _ in plan:
            if self._slots[slot].prefill.finished:
                updates.append(self._begin(slot))
        decoding = [i for i, s in enumerate(self._slots) if s is not None and s.prefill is None]
        if set(decoding) <= {u.slot for u in updates if u.finished}:  # none, or only slots that began and ended
            return updates
        progress = self.progress
        before = progress.generated.clone()
        was_active = progress.active.clone()
        verdict = self.decoder.round(progress, self._slot_sampling(), timer=timer)
        # The tokens each slot committed this round: at most Γ+1 columns from its previous count on.
        cols = (before[:, None] + torch.arange(self.gamma + 1, device=self.device)[None]).clamp_max(progress.width)
        new = progress.out.gather(1, cols)  # [B, Γ+1]
        count = torch.where(was_active, progress.generated - before, 0)
        rows = torch.cat([new, count[:, None], verdict.accepted[:, None], was_active[:, None].long(),
                          progress.active[:, None].long()], dim=1).tolist()
        for i in decoding:  # the one host sync of the step (above)
            *tokens, n, accepted, took_part, active = rows[i]
            if took_part:
                updates.append(SlotUpdate(i, tokens[:n], finished=not active, accepted=accepted))
        return updates

    def _plan(self) -> list[tuple[int, int]]:
        """The chunks this step prefills: the waiting admissions oldest first, each as many chunks as the budget
        leaves (at least one chunk in all), stopping at the first that it cannot finish."""
        plan, used = [], 0
        for slot in self.prefilling:
            left, chunks = self._slots[slot].prefill.remaining, 0
            while left:
                cost = min(self.prefill_chunk, left)
                if used and used + cost > self.prefill_budget:
                    break
                used, left, chunks = used + cost, left - cost, chunks + 1
            if chunks:
                plan.append((slot, chunks))
            if left:
                break
        return plan
