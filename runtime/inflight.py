"""In-flight batching: requests join and leave a decoder's batch slots between rounds.

    admit(request) -> slot     prefill one slot, sample its first token
    step()                     one round (speculative) or one token (vanilla) for every slot
    release(slot)              the slot takes the next waiting request

The decoders' own `generate()` runs one static batch; this drives the same decoder objects from outside,
slot by slot. Every slot carries its own sampling parameters, token limit and random generator, so a
request's tokens are those of `decoder.generate([prompt])` on a single-slot decoder with the same seed,
whatever else shares the batch (per-slot randomness is drawn in the same order `generate` draws it).

One host sync per step (`step` reads back the tokens each slot committed, for streaming and admission).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.acceptance import greedy_accept, rejection_accept
from trtllm_dustin.runtime.prefill import prefill
from trtllm_dustin.runtime.sampling import SamplingParams, sample, sampling_probs
from trtllm_dustin.runtime.speculative import DecodeState, SpeculativeDecoder
from trtllm_dustin.runtime.vanilla import VanillaDecoder, check_request

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
    generator: torch.Generator  # this request's randomness, seeded like generate() seeds it
    sent: int = 0  # tokens already reported


class InflightBatcher:
    """Drives a VanillaDecoder or SpeculativeDecoder with slot-level admission and per-slot limits/sampling."""

    def __init__(self, decoder: VanillaDecoder | SpeculativeDecoder, eos_token_ids: Sequence[int] = (),
                 prefill_chunk: int = 2048) -> None:
        self.decoder = decoder
        self.speculative = isinstance(decoder, SpeculativeDecoder)
        self.cache: KVCache = decoder.tcache if self.speculative else decoder.cache
        self.device = self.cache.seqlens.device
        self.prefill_chunk = prefill_chunk
        self.gamma = decoder.gamma if self.speculative else 0
        slots, width = self.cache.batch_slots, self.cache.max_seq_len
        self._slots: list[_Slot | None] = [None] * slots
        self.limits = torch.zeros(slots, dtype=torch.long, device=self.device)  # each slot's max_new_tokens
        # The decoders' round state, for every slot at once; out's last column takes masked writes.
        self.state = DecodeState(
            out=torch.full((slots, width + 1), -1, dtype=torch.long, device=self.device),
            active=torch.zeros(slots, dtype=torch.bool, device=self.device),
            generated=torch.zeros(slots, dtype=torch.long, device=self.device),
            hist=torch.zeros(self.gamma + 1, dtype=torch.long, device=self.device),
            eos=torch.tensor(tuple(eos_token_ids) or (-1,), device=self.device),
            generator=torch.Generator(device=self.device))
        self.current = torch.zeros(slots, 1, dtype=torch.long, device=self.device)  # vanilla: the next input token
        self.width = width
        self._reset_idle(torch.ones(slots, dtype=torch.bool, device=self.device))

    # ---- slots -------------------------------------------------------------------------------------------
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
        if self.speculative:
            check_request([request.prompt], self.cache, request.max_new_tokens, lookahead=self.gamma)
        else:
            check_request([request.prompt], self.cache, request.max_new_tokens)

    @torch.inference_mode()
    def admit(self, request: SlotRequest) -> tuple[int, SlotUpdate]:
        """Prefill a free slot with the request; return the slot and its first token (from the prefill logits)."""
        self.check(request)
        slot = self._slots.index(None) if None in self._slots else -1
        if slot < 0:
            raise RuntimeError("no free batch slot; admit only when free_slots > 0")
        seed = request.sampling.seed
        if self.speculative:
            first = self._prefill_speculative(slot, request)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        else:  # vanilla's generate() samples the first token from the same generator as the rest
            generator = torch.Generator(device=self.device).manual_seed(seed)
            logits = self._prefill_slot(self.decoder.model, self.cache, slot, request.prompt)[0]
            first = sample(logits, request.sampling, generator)  # [1]
            self.current[slot, 0] = first[0]
        st = self.state
        st.out[slot].fill_(-1)
        st.out[slot, 0] = first[0]
        st.generated[slot] = 1
        self.limits[slot] = request.max_new_tokens
        st.active[slot] = ~torch.isin(first[0], st.eos) & (request.max_new_tokens > 1)
        self._slots[slot] = _Slot(request, generator, sent=1)
        # The one host sync of admission: the first token is streamed now (time to first token).
        token, active = int(first[0]), bool(st.active[slot])
        return slot, SlotUpdate(slot, [token], finished=not active)

    def release(self, slot: int) -> None:
        """Free a slot (finished or cancelled); it runs along idle until the next admission."""
        if self._slots[slot] is None:
            raise ValueError(f"slot {slot} is not in use")
        self._slots[slot] = None
        idle = torch.zeros(self.batch_slots, dtype=torch.bool, device=self.device)
        idle[slot] = True
        self.state.active[slot] = False
        self._reset_idle(idle)

    def _reset_idle(self, idle: torch.Tensor) -> None:
        # Idle slots run along so every step keeps one shape. Speculative: at position 1 (the draft's first step
        # reads L - 1); vanilla: at position 0. Their writes land in positions no one reads.
        if self.speculative:
            self.cache.seqlens.masked_fill_(idle, 1)
            self.decoder.dcache.seqlens.copy_(self.cache.seqlens)
            self.decoder.cur.masked_fill_(idle, 0)
            self.decoder.prev.masked_fill_(idle, 0)
        else:
            self.cache.seqlens.masked_fill_(idle, 0)
            self.current.masked_fill_(idle[:, None], 0)

    def _prefill_slot(self, model, cache: KVCache, slot: int, prompt: Sequence[int], capture_layers=()):
        view = KVCache(cache.k[:, slot: slot + 1], cache.v[:, slot: slot + 1], cache.seqlens[slot: slot + 1])
        return prefill(model, view, self.decoder.backend, [prompt], self.prefill_chunk, capture_layers)

    def _prefill_speculative(self, slot: int, request: SlotRequest) -> torch.Tensor:
        dec = self.decoder
        logits, last_queries = self._prefill_slot(dec.target, dec.tcache, slot, request.prompt,
                                                  dec.target_capture_layers)
        self._prefill_slot(dec.draft, dec.dcache, slot, request.prompt)
        # Dustin's round-1 target history is the prompt end's query; after_prefill() writes rows 0..B-1 only,
        # so the slot's row is written here (see docs/serving.md, "runtime changes").
        history = getattr(dec, "history_q", {})
        for layer, q in last_queries.items():
            history[layer][slot, 0] = q[0]
        # generate() samples the first token with seed + 1 and the rounds with seed.
        first = sample(logits, request.sampling, torch.Generator(device=self.device).manual_seed(
            request.sampling.seed + 1))  # [1]
        dec.cur[slot] = first[0]
        dec.prev[slot] = request.prompt[-1]
        return first

    # ---- one step for every slot -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[SlotUpdate]:
        """Advance every active slot by one round (or token); return what each active slot committed."""
        slots = [i for i, s in enumerate(self._slots) if s is not None]
        st = self.state
        before = st.generated.clone()
        was_active = st.active.clone()
        accepted = self._speculative_round() if self.speculative else self._vanilla_step()
        st.active &= st.generated < self.limits
        # The tokens each slot committed this step: at most Γ+1 columns from its previous count on.
        cols = (before[:, None] + torch.arange(self.gamma + 1, device=self.device)[None]).clamp_max(self.width)
        new = st.out.gather(1, cols)  # [B, Γ+1]
        count = torch.where(was_active, torch.minimum(st.generated, self.limits) - before, 0)
        rows = torch.cat([new, count[:, None], accepted[:, None], st.active[:, None].long()], dim=1).tolist()
        updates = []
        for i in slots:  # the one host sync of the step (above): tokens for streaming, finished slots for admission
            *tokens, n, a, active = rows[i]
            if not was_active[i]:
                continue
            updates.append(SlotUpdate(i, tokens[:n], finished=not active, accepted=a))
        return updates

    def _vanilla_step(self) -> torch.Tensor:
        dec, st = self.decoder, self.state
        logits = dec.decode_one_token(self.current)  # [B, V]
        self.cache.seqlens.add_(st.active.int())  # commit the token just processed
        nxt = self._sample_rows(logits, lambda slot: (slot.request.sampling, slot.generator))
        st.out.scatter_(1, torch.where(st.active, st.generated, self.width)[:, None], nxt[:, None])
        self.current[:, 0] = torch.where(st.active, nxt, self.current[:, 0])
        st.generated += st.active.long()
        st.active &= ~torch.isin(nxt, st.eos)
        return torch.zeros_like(nxt)

    def _speculative_round(self) -> torch.Tensor:
        """SpeculativeDecoder.round() with per-slot sampling: draft -> estimate -> select -> verify -> accept ->
        commit. Its phases are the decoder's own (graph-captured on CUDA); only sampling is per slot."""
        dec, st = self.decoder, self.state
        sampled = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.request.sampling.greedy]
        for step in range(dec.gamma):
            logits = dec._run_draft(step, greedy=not sampled)  # [B, V]; an all-greedy step writes its tokens itself
            if not sampled:
                continue
            tokens = argmax_last(logits)
            for i, s in sampled:
                row = logits[i: i + 1]
                tokens[i] = sample(row, s.request.sampling, s.generator)[0]
                dec.draft_probs[i, step] = sampling_probs(row, s.request.sampling)[0]
            dec.draft_tokens[:, step] = tokens
        if dec.indices is not None:  # sparse verification: choose what the target reads this round
            dec._run("estimate", dec.estimate)
            dec._run("select", dec.select)
        target_logits = dec._run("verify", dec._verify_forward)  # [B, Γ+1, V]
        accepted, nxt = greedy_accept(dec.draft_tokens, target_logits)
        for i, s in sampled:
            a, n = rejection_accept(dec.draft_tokens[i: i + 1], dec.draft_probs[i: i + 1], target_logits[i: i + 1],
                                    s.request.sampling, s.generator)
            accepted[i], nxt[i] = a[0], n[0]
        dec.commit(st, accepted, nxt, self.width)
        return accepted

    def _sample_rows(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Greedy rows by one argmax; each sampled slot from its own generator, as a batch of one."""
        tokens = argmax_last(logits)
        for i, s in enumerate(self._slots):
            if s is not None and not s.request.sampling.greedy:
                sampling, generator = params(s)
                tokens[i] = sample(logits[i: i + 1], sampling, generator)[0]
        return tokens
