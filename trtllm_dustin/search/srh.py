"""Semantic Retrieval Head identification (paper Sec. 4.2.1, following CompressKV's procedure).

For each needle-in-a-haystack prompt the model decodes greedily (up to 50 tokens). At every step whose generated
token occurs in the needle span, each head adds the attention mass its query puts on the needle span. A test counts
only when the answer's ROUGE-1 recall against the needle exceeds 0.5; a head's score is its mean over counted tests;
each layer keeps its top heads (4 by default). The query that produced a token is the one of the step before it (the
prompt's last token for the first), so the mass is read from that step's captured queries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import LayerHeads, model_fingerprint
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.runtime.prefill import prefill
from trtllm_dustin.search.attention_probe import head_attention
from trtllm_dustin.search.needle_haystack import NEEDLES, NeedlePrompt, build_prompt, decode, haystack_tokens
from trtllm_dustin.search.rouge import rouge1_recall
from trtllm_dustin.validation import read_versioned, versioned_json

__all__ = [
    "SRH_SCHEMA_VERSION",
    "SRHResult",
    "SRHSettings",
    "SRHTest",
    "head_scores",
    "identify_srh",
    "needle_mass",
    "top_heads",
]

SRH_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class SRHSettings:
    """The profiling set and the scoring rule. Defaults are the issue's full scale; CI passes a tiny one."""

    # prompt tokens: 10 steps of 814 up to 8140, so that 8140 + max_new_tokens (50) fits SmolLM2's 8192 positions
    context_lengths: tuple[int, ...] = tuple(814 * i for i in range(1, 11))
    depths: tuple[float, ...] = tuple(i / 10 for i in range(11))  # needle depth in the haystack, 0 = start
    needles: int = 3  # how many of NEEDLES to use (at least 3 for the real profile)
    max_new_tokens: int = 50  # greedy decode length per test
    min_recall: float = 0.5  # a test counts when ROUGE-1 recall(answer, needle) is above this
    heads_per_layer: int = 4  # SRHs kept per layer
    batch: int = 4  # prompts (depths of one needle and length) decoded together
    chunk: int = 1024  # prefill chunk

    def __post_init__(self) -> None:
        object.__setattr__(self, "context_lengths", tuple(int(n) for n in self.context_lengths))
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        if not self.context_lengths or min(self.context_lengths) < 16:
            raise ConfigError(f"context_lengths {self.context_lengths} must be non-empty and each >= 16 tokens")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"depths {self.depths} must be non-empty and lie in [0, 1]")
        if not 1 <= self.needles <= len(NEEDLES):
            raise ConfigError(f"needles={self.needles} must lie in [1, {len(NEEDLES)}] (the built-in needles)")
        for name in ("max_new_tokens", "heads_per_layer", "batch", "chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class SRHTest:
    """One needle-in-a-haystack test: its answer, its recall, and every head's summed needle mass."""

    needle: int  # index into NEEDLES
    context_length: int
    depth: float
    recall: float  # ROUGE-1 recall of the answer against the needle sentence
    needle_steps: int  # decode steps whose token occurs in the needle span
    answer: str
    scores: tuple[tuple[float, ...], ...]  # [layer][head]: attention mass on the needle summed over needle steps

    def __post_init__(self) -> None:
        object.__setattr__(self, "scores", tuple(tuple(float(x) for x in row) for row in self.scores))


@dataclass(frozen=True)
class SRHResult:
    """Per-layer SRH lists and the raw scores behind them, for one model. Written as JSON, read by the search."""

    model: str  # the model's name (ModelConfig.name)
    fingerprint: str  # model_fingerprint of that model
    settings: SRHSettings
    tests: tuple[SRHTest, ...]
    note: str = ""  # e.g. why the numbers mean nothing (random weights)
    provenance: dict[str, Any] = field(default_factory=dict)  # command, machine, git SHA, date, wall time

    def __post_init__(self) -> None:
        if not isinstance(self.settings, SRHSettings):
            object.__setattr__(self, "settings", SRHSettings(**self.settings))
        object.__setattr__(self, "tests", tuple(t if isinstance(t, SRHTest) else SRHTest(**t) for t in self.tests))

    @property
    def counted(self) -> int:
        return sum(t.recall > self.settings.min_recall for t in self.tests)

    def scores(self) -> torch.Tensor:
        """fp64 [layers, heads]: each head's mean needle mass over counted tests (NaN when none counted)."""
        per_test = torch.tensor([t.scores for t in self.tests], dtype=torch.float64)
        recalls = torch.tensor([t.recall for t in self.tests], dtype=torch.float64)
        return head_scores(per_test, recalls, self.settings.min_recall)

    @property
    def layers(self) -> tuple[LayerHeads, ...]:
        """The top heads of every layer; empty when no test counted."""
        scores = self.scores()
        return () if torch.isnan(scores).all() else top_heads(scores, self.settings.heads_per_layer)

    def heads_of(self, layer: int) -> tuple[int, ...]:
        by_layer = {lh.layer: lh.heads for lh in self.layers}
        if layer not in by_layer:
            raise ConfigError(f"SRH result for {self.model} has no heads (no test reached ROUGE-1 recall > "
                              f"{self.settings.min_recall}); re-profile with longer answers or --srh-min-recall lower")
        return by_layer[layer]

    def with_min_recall(self, min_recall: float) -> SRHResult:
        """The same tests scored under another counting threshold (no re-profiling needed)."""
        return replace(self, settings=replace(self.settings, min_recall=min_recall))

    def to_json(self) -> str:
        scores = self.scores()
        payload = {"model": self.model, "fingerprint": self.fingerprint,
                   "note": self.note, "provenance": self.provenance, "settings": asdict(self.settings),
                   "counted_tests": self.counted, "total_tests": len(self.tests),
                   "layers": [asdict(lh) for lh in self.layers],
                   "head_scores": [[None if math.isnan(x) else round(x, 6) for x in row] for row in scores.tolist()],
                   "tests": [asdict(t) for t in self.tests]}
        return versioned_json(SRH_SCHEMA_VERSION, payload, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SRHResult:
        data = read_versioned(text, (SRH_SCHEMA_VERSION,), "SRH file", "re-run SRH profiling")
        for derived in ("counted_tests", "total_tests", "layers", "head_scores"):
            data.pop(derived)
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> SRHResult:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"SRH file {path} does not exist; write one with `trtllm-dustin srh --out {path}`")
        return cls.from_json(path.read_text())

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")


def needle_mass(probs: torch.Tensor, span_mask: torch.Tensor) -> torch.Tensor:
    """probs [B, H, S] (one query per row), span_mask bool [B, S] -> [B, H]: each head's mass on the needle span."""
    return (probs * span_mask[:, None, :]).sum(-1)


def head_scores(per_test: torch.Tensor, recalls: torch.Tensor, min_recall: float) -> torch.Tensor:
    """per_test [N, L, H] summed needle masses, recalls [N] -> [L, H] mean over tests with recall > min_recall."""
    counted = recalls > min_recall
    if not bool(counted.any()):
        return torch.full(per_test.shape[1:], float("nan"), dtype=per_test.dtype)
    return per_test[counted].mean(0)


def top_heads(scores: torch.Tensor, k: int) -> tuple[LayerHeads, ...]:
    """The k best heads of every layer by score (ties go to the lower head index), heads listed best first."""
    layers = []
    for layer, row in enumerate(scores.tolist()):
        order = sorted(range(len(row)), key=lambda h: (-row[h], h))
        layers.append(LayerHeads(layer, tuple(order[: min(k, len(row))])))
    return tuple(layers)


@torch.inference_mode()
def _run_batch(model: Transformer, backend: AttentionBackend, prompts: Sequence[NeedlePrompt],
               max_new_tokens: int, chunk: int) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """Greedy-decode a batch of prompts -> summed needle masses [B, L, H], generated ids, needle-step counts [B]."""
    config = model.config
    device = model.embed.weight.device
    B, layers = len(prompts), tuple(range(config.num_layers))
    longest = max(len(p.tokens) for p in prompts)
    cache = KVCache.allocate(config, B, longest + max_new_tokens, model.embed.weight.dtype, device)
    logits, last_q = prefill(model, cache, backend, [p.tokens for p in prompts], chunk=chunk, capture_layers=layers)
    queries = {layer: q[:, None] for layer, q in last_q.items()}  # layer -> [B, 1, H_q, D] of the last position
    positions = torch.arange(cache.max_seq_len, device=device)
    span_mask = torch.stack([(positions >= p.needle_span[0]) & (positions < p.needle_span[1]) for p in prompts])
    needle_ids = [torch.tensor(sorted(set(p.needle_tokens)), device=device) for p in prompts]
    eos = torch.tensor(config.eos_token_ids or (-1,), device=device)
    scores = torch.zeros(B, config.num_layers, config.num_heads, dtype=torch.float64)
    steps = torch.zeros(B, dtype=torch.long)
    active = torch.ones(B, dtype=torch.bool, device=device)
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        token = logits.argmax(-1)  # [B]
        active &= ~torch.isin(token, eos)
        in_needle = torch.stack([torch.isin(token[b], needle_ids[b]) for b in range(B)]) & active  # [B]
        if bool(in_needle.any()):  # one host sync per step: offline profiling, not a decode round
            query_pos = (cache.seqlens.long() - 1)[:, None]  # [B, 1]: the query that produced `token`
            for layer in layers:  # one layer's probabilities at a time
                probs = head_attention(queries[layer], cache.k[layer], query_pos)[:, 0]  # [B, H, S]
                scores[:, layer] += (needle_mass(probs, span_mask) * in_needle[:, None]).double().cpu()
            steps += in_needle.long().cpu()
        for b in torch.nonzero(active).flatten().tolist():
            generated[b].append(int(token[b]))
        if not bool(active.any()):
            break
        buffers = {layer: torch.empty(B, 1, config.num_heads, config.head_dim, dtype=cache.k.dtype, device=device)
                   for layer in layers}
        meta = AttentionMetadata(cache_seqlens=cache.seqlens)
        logits = model(token[:, None], cache, meta, backend, logit_index=torch.zeros(B, dtype=torch.long,
                                                                                       device=device),
                       capture=QueryCapture(layers, buffers))
        cache.seqlens.add_(1)
        queries = buffers
    return scores, generated, steps


def identify_srh(model: Transformer, tokenizer: Any, settings: SRHSettings, backend: AttentionBackend | None = None,
                 haystack: Sequence[int] | None = None, progress: bool = True, note: str = "") -> SRHResult:
    """Profile every (needle, context length, depth) test and return the per-head scores and top heads.

    `tokenizer` must share the model's vocabulary (a draft uses its target's); `haystack` defaults to the
    validation split's essays (haystack_tokens).
    """
    backend = backend or get_backend("reference")
    if max(settings.context_lengths) + settings.max_new_tokens > model.max_positions:
        raise ConfigError(f"context length {max(settings.context_lengths)} + {settings.max_new_tokens} new tokens "
                          f"exceeds {model.config.name}'s {model.max_positions} positions; lower the lengths")
    if haystack is None:
        haystack = haystack_tokens(tokenizer, max(settings.context_lengths))
    groups = [(n, length, settings.depths[i: i + settings.batch]) for n in range(settings.needles)
              for length in settings.context_lengths for i in range(0, len(settings.depths), settings.batch)]
    tests: list[SRHTest] = []
    bar = tqdm(total=settings.needles * len(settings.context_lengths) * len(settings.depths), disable=not progress,
               desc=f"SRH profiling {model.config.name}", unit="test")
    for needle_index, length, depths in groups:
        needle = NEEDLES[needle_index]
        prompts = [build_prompt(tokenizer, haystack, needle, length, depth) for depth in depths]
        scores, generated, steps = _run_batch(model, backend, prompts, settings.max_new_tokens, settings.chunk)
        for b, prompt in enumerate(prompts):
            answer = decode(tokenizer, generated[b])
            tests.append(SRHTest(needle_index, length, prompt.depth, round(rouge1_recall(answer, needle.text), 4),
                                 int(steps[b]), answer.strip()[:300],
                                 tuple(tuple(round(x, 6) for x in row) for row in scores[b].tolist())))
        bar.update(len(prompts))
        bar.set_postfix(counted=sum(t.recall > settings.min_recall for t in tests))
    bar.close()
    return SRHResult(model.config.name, model_fingerprint(model.config), settings, tuple(tests), note)
