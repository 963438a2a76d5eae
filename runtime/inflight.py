"""In-flight batching: requests join and leave a Decoder's batch slots between rounds.

    admit(request) -> slot     prefill one slot (and its drafter / selector hooks), sample its first token
    step()                     one Decoder.round for every slot
    release(slot)              the slot runs along idle until the next admission

The round is the decoder's own, the one `generate()` runs. Every slot carries its own sampling parameters, token
limit and random generator (per-slot SlotSampling), so a request's tokens are those of `decoder.generate([prompt])`
on a single-slot decoder with the same seed, whatever else shares the batch.

One host sync per step (`step` reads back the tokens each slot committed, for streaming and admission).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtllm_dustin.runtime.decoder import Decoder
from trtllm_dustin.runtime.generation import check_request
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


@dataclass
class _Slot:
    request: SlotRequest
    generator: torch.Generator | None  # this request's round randomness (seed), None when greedy


class InflightBatcher:
    def __init__(self, decoder: Decoder, eos_token_ids: tuple[int, ...] | list[int] = (), prefill_chunk: int = 2048
                 ) -> None:
        self.decoder = decoder
        self.cache = decoder.cache
        self.device = decoder.device
        self.prefill_chunk = prefill_chunk
        slots = self.cache.batch_slots
        self._slots: list[_Slot | None] = [None] * slots
        self.progress = Progress.allocate(slots, self.cache.max_seq_len, decoder.gamma, eos_token_ids, self.device)
        self._sampling: SlotSampling | None = None  # rebuilt when a slot is admitted or released
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

    def check(self, request: SlotRequest) -> None:
        """Raise ValueError (with the limit and the fix) when the request can never run in these caches."""
        check_request([request.prompt], self.cache, request.max_new_tokens, lookahead=self.gamma)

    @torch.inference_mode()
    def admit(self, request: SlotRequest) -> tuple[int, SlotUpdate]:
        """Prefill a free slot with the request; return the slot and its first token (from the prefill logits)."""
        self.check(request)
        if None not in self._slots:
            raise RuntimeError("no free batch slot; admit only when free_slots > 0")
        slot = self._slots.index(None)
        slots, prompt, sampling = slice(slot, slot + 1), [list(request.prompt)], request.sampling
        logits = self.decoder.prefill(slots, prompt, self.prefill_chunk)  # [1, V]
        # As generate(): the first token from seed + 1, the rounds from seed.
        first = SlotSampling.batch(sampling, 1, self.device, seed=sampling.seed + 1,
                                   use_kernel=self.decoder.kernels.round_kernels).pick(logits)
        self.decoder.begin(self.progress, slots, first, prompt, request.max_new_tokens)
        generator = None if sampling.greedy else torch.Generator(device=self.device).manual_seed(sampling.seed)
        self._slots[slot] = _Slot(request, generator)
        self._sampling = None
        # The one host sync of admission: the first token is streamed now (time to first token).
        token, active = int(first[0]), bool(self.progress.active[slot])
        return slot, SlotUpdate(slot, [token], finished=not active)

    def release(self, slot: int) -> None:
        """Free a slot (finished or cancelled); it runs along idle until the next admission."""
        if self._slots[slot] is None:
            raise ValueError(f"slot {slot} is not in use")
        self._slots[slot] = None
        self._sampling = None
        self.decoder.release(self.progress, slot)

    def _slot_sampling(self) -> SlotSampling:
        if self._sampling is None:
            self._sampling = SlotSampling([s.request.sampling if s else None for s in self._slots],
                                          [s.generator if s else None for s in self._slots], self.device,
                                          self.decoder.kernels.round_kernels)
        return self._sampling

    @torch.inference_mode()
    def step(self) -> list[SlotUpdate]:
        """Advance every active slot by one round; return what each active slot committed."""
        progress = self.progress
        before = progress.generated.clone()
        was_active = progress.active.clone()
        verdict = self.decoder.round(progress, self._slot_sampling())
        # The tokens each slot committed this round: at most Γ+1 columns from its previous count on.
        cols = (before[:, None] + torch.arange(self.gamma + 1, device=self.device)[None]).clamp_max(progress.width)
        new = progress.out.gather(1, cols)  # [B, Γ+1]
        count = torch.where(was_active, progress.generated - before, 0)
        rows = torch.cat([new, count[:, None], verdict.accepted[:, None], was_active[:, None].long(),
                          progress.active[:, None].long()], dim=1).tolist()
        updates = []
        for i, slot in enumerate(self._slots):  # the one host sync of the step (above)
            *tokens, n, accepted, took_part, active = rows[i]
            if slot is not None and took_part:
                updates.append(SlotUpdate(i, tokens[:n], finished=not active, accepted=accepted))
        return updates
