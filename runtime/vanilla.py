"""Vanilla batched decoding: chunked ragged prefill, then one token per step (CUDA-graph replay on GPU).

    prefill(prompts) -> logits of each prompt's last token
    decode_one_token(tokens) -> next logits; commit -> seqlens += active
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.runtime.cuda_graph import CapturedStep
from trtllm_dustin.runtime.prefill import prefill
from trtllm_dustin.runtime.sampling import SamplingParams, sample

__all__ = ["GenerationConfig", "GenerationResult", "VanillaDecoder", "check_request"]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64  # per sequence
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # a sequence stops after emitting any of these
    prefill_chunk: int = 2048  # prompt tokens per prefill forward: bounds activation memory on long prompts
    sync_every: int = 16  # decode steps between host checks of "all sequences finished"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 1")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence, EOS included when it was emitted
    prefill_ms: float
    decode_ms: float
    decode_steps: int

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = self.generated - len(self.tokens)  # the first token of each sequence comes from prefill
        return decoded / (self.decode_ms / 1e3) if self.decode_ms > 0 else float("nan")


def check_request(prompts: Sequence[Sequence[int]], cache: KVCache, max_new_tokens: int, lookahead: int = 0) -> None:
    """Reject a request that cannot run, before any device work, with what to change.

    lookahead: positions a step writes past the last committed token (speculative rounds: gamma).
    """
    if not prompts:
        raise ValueError("no prompts given")
    if len(prompts) > cache.batch_slots:
        raise ValueError(f"{len(prompts)} prompts exceed the {cache.batch_slots} batch slots; raise --batch-size")
    extra = f" + gamma {lookahead}" if lookahead else ""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        need = len(p) + max_new_tokens + lookahead
        if need > cache.max_seq_len:
            raise ValueError(f"--max-seq-len {cache.max_seq_len} is smaller than prompt {i} ({len(p)} tokens) + "
                             f"--max-new-tokens {max_new_tokens}{extra} = {need}; raise --max-seq-len or truncate "
                             "the prompt")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VanillaDecoder:
    """Autoregressive decoding of a batch of ragged prompts with one model and its static cache."""

    def __init__(self, model: Transformer, cache: KVCache, backend: AttentionBackend, use_cuda_graph: bool = True
                 ) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.device = cache.seqlens.device
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        self._step: CapturedStep | None = None
        self._decode_meta = AttentionMetadata(cache_seqlens=cache.seqlens)

    def prefill(self, prompts: Sequence[Sequence[int]], chunk: int = 2048) -> torch.Tensor:
        """Write the prompts' K/V into slots 0..B-1 and return the last prompt token's logits [B, V]."""
        return prefill(self.model, self.cache, self.backend, prompts, chunk)[0]

    def _forward_step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, self.cache, self._decode_meta, self.backend)[:, 0]  # [B, V]

    @torch.inference_mode()
    def decode_one_token(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B_slots, 1] at positions seqlens -> logits [B_slots, V]. Does not advance seqlens."""
        if not self.use_cuda_graph:
            return self._forward_step(tokens)
        if self._step is None:
            self._step = CapturedStep(self._forward_step, tokens.clone())
        return self._step(tokens)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig, profile: bool = False
                 ) -> GenerationResult:
        """Decode every prompt to EOS or max_new_tokens. (`profile` is accepted for a uniform interface:
        a vanilla step has one phase.)"""
        check_request(prompts, self.cache, config.max_new_tokens)
        B, slots = len(prompts), self.cache.batch_slots
        self.cache.seqlens.zero_()  # idle slots decode along at position 0
        generator = torch.Generator(device=self.device).manual_seed(config.sampling.seed)
        eos = torch.tensor(config.eos_token_ids or (-1,), device=self.device)

        _sync(self.device)
        t0 = time.perf_counter()
        logits = self.prefill(prompts, config.prefill_chunk)
        first = sample(logits, config.sampling, generator)  # [B]
        # Decode runs on all slots so the captured step keeps one shape; slots past B are inactive.
        current = torch.zeros(slots, 1, dtype=torch.long, device=self.device)
        current[:B, 0] = first
        if self.use_cuda_graph and self._step is None:  # one-time JIT + capture, kept out of the decode time
            self.decode_one_token(current)
        _sync(self.device)
        t1 = time.perf_counter()

        out = torch.full((slots, config.max_new_tokens), -1, dtype=torch.long, device=self.device)
        active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        active[:B] = True
        out[:, 0] = torch.where(active, current[:, 0], -1)
        active &= ~torch.isin(current[:, 0], eos)
        steps = 0
        for step in range(1, config.max_new_tokens):
            logits = self.decode_one_token(current)
            self.cache.seqlens.add_(active.int())  # commit the token just processed
            nxt = sample(logits, config.sampling, generator)
            out[:, step] = torch.where(active, nxt, -1)
            current[:, 0] = torch.where(active, nxt, current[:, 0])
            active &= ~torch.isin(nxt, eos)
            steps += 1
            # The one host sync of the loop, every sync_every steps: stop early once every sequence is done.
            if step % config.sync_every == 0 and not bool(active.any()):
                break
        _sync(self.device)
        t2 = time.perf_counter()
        rows = out[:B].tolist()
        tokens = [[t for t in row if t >= 0] for row in rows]
        return GenerationResult(tokens, (t1 - t0) * 1e3, (t2 - t1) * 1e3, steps)
