"""What a caller asks of a decode run, and what it gets back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.sampling import SamplingParams

__all__ = ["GenerationConfig", "GenerationResult", "check_lengths", "check_request"]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64  # per sequence
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # a sequence stops after emitting any of these
    # prompt tokens per sequence per prefill forward (bounds activation memory on long prompts); None: the measured
    # choice for the batch, runtime/prefill.py prefill_chunk_for
    prefill_chunk: int | None = None
    # GPU: rounds between the host's blocking reads of "all sequences finished" (between them the flag is read as its
    # asynchronous copy lands, runtime/decoder.py _FinishCheck); the CPU reads it after every round, at no cost
    sync_every: int = 16
    # GPU: how many rounds the host may queue past the newest round whose flag it has read. Before it queues more it
    # waits for that round's flag, on an event the device passed while it still holds `run_ahead` rounds of queued
    # work (so the device does not idle unless the host needs longer than those rounds to queue one); the idle rounds
    # after the last sequence finishes are then at most `run_ahead`. 0: no bound (only sync_every's reads)
    run_ahead: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 1")
        if self.sync_every < 1:
            raise ValueError(f"sync_every={self.sync_every} must be >= 1")
        if self.run_ahead < 0:
            raise ValueError(f"run_ahead={self.run_ahead} must be >= 0 (0: no bound)")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence, EOS included when it was emitted
    prefill_ms: float  # until every sequence has its first token (the time to first token)
    setup_ms: float  # CUDA-graph capture and kernel warm-up after it, before the first round (0 on the CPU)
    decode_ms: float  # every round run, any idle ones after the last sequence finished included (GPU: sync_every)
    rounds: int  # rounds run (vanilla: decode steps)
    decoding_rounds: int  # rounds in which at least one sequence was still generating (the first `decoding_rounds`)
    decoding_ms: float  # from the decode start to the end of the last decoding round
    round_ms: list[float] = field(default_factory=list)  # [r]: decode start -> end of round r + 1
    committed_hist: list[int] = field(default_factory=list)  # [n] = sequence-rounds that committed n + 1 tokens
    phase_ms: dict[str, float] = field(default_factory=dict)  # filled by a profiling run (profile=True)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each sequence's first (which comes from the prefill) per second of the decoding rounds:
        the idle rounds that run until the loop's next finished-check are not counted."""
        decoded = self.generated - len(self.tokens)
        return decoded / (self.decoding_ms / 1e3) if self.decoding_ms > 0 else float("nan")

    @property
    def tau(self) -> float:
        """Mean tokens committed per sequence per round (accepted draft tokens + 1), 1 <= tau <= Γ + 1."""
        rounds = sum(self.committed_hist)
        return sum((n + 1) * c for n, c in enumerate(self.committed_hist)) / rounds if rounds else float("nan")


def check_request(prompts: Sequence[Sequence[int]], cache: KVCache, max_new_tokens: int, lookahead: int = 0) -> None:
    """Reject a request that cannot run in `cache`, before any device work, with what to change.

    lookahead: positions a round writes past the last committed token (speculative rounds: gamma).
    """
    check_lengths(prompts, cache.batch_slots, cache.max_seq_len, max_new_tokens, lookahead)


def check_lengths(prompts: Sequence[Sequence[int]], batch_slots: int, max_seq_len: int, max_new_tokens: int,
                  lookahead: int = 0) -> None:
    """`check_request` against a cache of `batch_slots` x `max_seq_len` that need not exist yet (the command line
    checks before loading any weight)."""
    if not prompts:
        raise ValueError("no prompts given")
    if len(prompts) > batch_slots:
        raise ValueError(f"{len(prompts)} prompts exceed the {batch_slots} batch slots; raise --batch-size")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    extra = f" + gamma {lookahead}" if lookahead else ""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        need = len(p) + max_new_tokens + lookahead
        if need > max_seq_len:
            raise ValueError(f"--max-seq-len {max_seq_len} is smaller than prompt {i} ({len(p)} tokens) + "
                             f"--max-new-tokens {max_new_tokens}{extra} = {need}; raise --max-seq-len or truncate "
                             "the prompt")
