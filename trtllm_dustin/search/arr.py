"""Attention Recovery Rate (paper Sec. 3.1, Eq. 1-4) and the KV-selection policies it compares.

ARR_i(π) = Σ_{j ∈ K_i} A_{i,j} (Eq. 1) with A normalised over the selectable positions V_i = [0, L_i). Over a
verification window of w = Γ+1 queries, ARR^(w)_i = (1/w) Σ_s ARR_{i+s} (Eq. 2), which equals Σ_{j ∈ K_i} Ā_{i,j}
for the future-averaged attention Ā (Eq. 3-4); the SD oracle keeps the top-k of Ā, so no k-subset beats it.

Policies (registry POLICIES) turn the signals a runtime has into a set K_i of at most k positions:
  oracle           TopK_k(Ā)                                           (upper bound; reads the future)
  target_history   Eq. 6 with m = 0: sinks + recent + TopK(S_target)   (Dustin-T)
  draft_lookahead  Eq. 6 with m = all free slots: ... + TopK(S_draft)  (Dustin-D)
  hybrid           Eq. 6 with the given m                              (Dustin-H)
  streaming        StreamingLLM: sinks + the most recent k - sinks
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from trtllm_dustin.config import ConfigError
from trtllm_dustin.plugins.selection import select_verify_indices, streaming_indices
from trtllm_dustin.search.attention_trace import AttentionTrace

__all__ = [
    "POLICIES",
    "ARREvaluator",
    "PolicyInputs",
    "arr",
    "future_average",
    "normalise_context",
    "oracle_indices",
    "scaled_m",
    "windowed_arr",
]


def normalise_context(attention: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """attention [R, S] -> the same restricted to [0, L_r) and renormalised there (the A of Eq. 1)."""
    context = torch.arange(attention.shape[-1], device=attention.device)[None, :] < seqlens.long()[:, None]
    masked = attention.float() * context
    return masked / masked.sum(-1, keepdim=True).clamp_min(1e-30)


def arr(attention: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Eq. 1 (and Eq. 4 given Ā): attention [R, S], indices int [R, K] (-1 = padding) -> [R] selected mass."""
    valid = indices >= 0
    return (torch.gather(attention, 1, indices.long().clamp_min(0)) * valid).sum(-1)


def future_average(attention: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """Eq. 3: attention [w, R, S] of the w future queries of each step -> Ā [R, S] (each normalised over [0, L))."""
    return torch.stack([normalise_context(a, seqlens) for a in attention]).mean(0)


def windowed_arr(attention: torch.Tensor, seqlens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Eq. 2: attention [w, R, S] -> [R], the mean over the window of each future query's ARR of one set."""
    return torch.stack([arr(normalise_context(a, seqlens), indices) for a in attention]).mean(0)


def oracle_indices(future: torch.Tensor, seqlens: torch.Tensor, budget: int) -> torch.Tensor:
    """Eq. 3: TopK_k(Ā) within [0, L) -> int32 [R, k] sorted, -1 padded (all of [0, L) when L <= k)."""
    R, S = future.shape
    k = min(budget, S)
    context = torch.arange(S, device=future.device)[None, :] < seqlens.long()[:, None]
    top = torch.topk(future.float().masked_fill(~context, float("-inf")), k, dim=1)
    chosen = torch.where(torch.isfinite(top.values), top.indices, S)  # S: a sentinel that sorts last
    padded = torch.full((R, budget), S, dtype=torch.int64, device=future.device)
    padded[:, :k] = chosen
    ordered = padded.sort(dim=1).values
    return torch.where(ordered < S, ordered, -1).to(torch.int32)


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy may read at each step: committed lengths, and the signals of its kind."""

    seqlens: torch.Tensor  # int32 [R]: L of each step
    future: torch.Tensor | None = None  # Ā [R, S] (the oracle only)
    s_target: torch.Tensor | None = None  # [R, S] target-history scores
    s_draft: torch.Tensor | None = None  # [R, S] draft-lookahead scores
    n_sink: int = 4
    n_recent: int = 16

    def need(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ConfigError(f"this policy needs {name}, which was not given")
        return value


def _oracle(x: PolicyInputs, budget: int, m: int) -> torch.Tensor:
    return oracle_indices(x.need("future"), x.seqlens, budget)


def _eq6(x: PolicyInputs, budget: int, m: int, s_draft: torch.Tensor, s_target: torch.Tensor) -> torch.Tensor:
    return select_verify_indices(s_draft, s_target, x.seqlens, budget, m, x.n_sink, x.n_recent)


def _target_history(x: PolicyInputs, budget: int, m: int) -> torch.Tensor:
    s_target = x.need("s_target")
    return _eq6(x, budget, 0, torch.zeros_like(s_target), s_target)


def _draft_lookahead(x: PolicyInputs, budget: int, m: int) -> torch.Tensor:
    s_draft = x.need("s_draft")
    return _eq6(x, budget, budget - x.n_sink - x.n_recent, s_draft, torch.zeros_like(s_draft))


def _hybrid(x: PolicyInputs, budget: int, m: int) -> torch.Tensor:
    return _eq6(x, budget, m, x.need("s_draft"), x.need("s_target"))


def _streaming(x: PolicyInputs, budget: int, m: int) -> torch.Tensor:
    return streaming_indices(x.seqlens, budget, x.n_sink)


Policy = Callable[[PolicyInputs, int, int], torch.Tensor]  # (inputs, budget k, draft share m) -> int32 [R, k]
POLICIES: dict[str, Policy] = {"oracle": _oracle, "target_history": _target_history,
                               "draft_lookahead": _draft_lookahead, "hybrid": _hybrid, "streaming": _streaming}


def scaled_m(m: int, budget: int, reference_budget: int, protected: int) -> int:
    """The draft share m tuned at `reference_budget`, carried to `budget` as the same fraction of the free slots."""
    free, reference_free = budget - protected, reference_budget - protected
    return max(0, min(free, round(m * free / reference_free))) if reference_free > 0 else 0


@dataclass
class ARREvaluator:
    """Mean windowed ARR (Eq. 2/4) of policies over an AttentionTrace, against its layer-averaged SRH attention."""

    trace: AttentionTrace
    n_sink: int = 4
    n_recent: int = 16
    _cache: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if min(self.n_sink, self.n_recent) < 0:
            raise ConfigError(f"n_sink={self.n_sink}, n_recent={self.n_recent} must be >= 0")

    @property
    def protected(self) -> int:
        return self.n_sink + self.n_recent

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(lh.layer for lh in self.trace.target_srh)

    @property
    def draft_layers(self) -> tuple[int, ...]:
        return tuple(lh.layer for lh in self.trace.draft_srh)

    def _s_target(self, layers: Sequence[int], delta: int) -> torch.Tensor:
        key = ("t", tuple(sorted(layers)), delta)
        if key not in self._cache:
            self._cache[key] = self.trace.target_history(layers, delta)
        return self._cache[key]

    def _s_draft(self, layers: Sequence[int]) -> torch.Tensor:
        key = ("d", tuple(sorted(layers)))
        if key not in self._cache:
            self._cache[key] = self.trace.draft_lookahead(layers)
        return self._cache[key]

    def _check_budget(self, budget: int) -> None:
        if budget <= self.protected:
            raise ConfigError(f"budget k={budget} must exceed sinks + recent window = {self.protected}")

    def indices(self, policy: str, budget: int, *, target_layers: Sequence[int] = (), draft_layers: Sequence[int] = (),
                m: int = 0, delta: int = 1) -> torch.Tensor:
        """int32 [R, k]: the set `policy` selects at every step of the trace."""
        if policy not in POLICIES:
            raise ConfigError(f"policy {policy!r} is unknown; choose one of {sorted(POLICIES)}")
        self._check_budget(budget)
        inputs = PolicyInputs(
            self.trace.seqlens, future=self.trace.truth if policy == "oracle" else None,
            s_target=self._s_target(target_layers, delta) if target_layers else None,
            s_draft=self._s_draft(draft_layers) if draft_layers else None, n_sink=self.n_sink, n_recent=self.n_recent)
        return POLICIES[policy](inputs, budget, m)

    def score(self, policy: str, budget: int, **kwargs) -> float:
        """Mean over steps of ARR^(w) (Eq. 4) against the layer-averaged SRH attention Ā."""
        return float(arr(self.trace.truth, self.indices(policy, budget, **kwargs)).mean())

    def score_by_layer(self, policy: str, budget: int, **kwargs) -> list[float]:
        """Mean ARR^(w) against each measured target layer's own SRH attention (the oracle keeps one global set)."""
        chosen = self.indices(policy, budget, **kwargs)
        return [float(arr(truth, chosen).mean()) for truth in self.trace.truth_by_layer]

    # The three objectives Algorithm 1 reads (search.ARRObjective).
    def target_history(self, target_layers: Sequence[int], budget: int, delta: int = 1) -> float:
        return self.score("target_history", budget, target_layers=target_layers, delta=delta)

    def draft_lookahead(self, draft_layers: Sequence[int], budget: int) -> float:
        return self.score("draft_lookahead", budget, draft_layers=draft_layers)

    def hybrid(self, target_layers: Sequence[int], draft_layers: Sequence[int], budget: int, m: int) -> float:
        return self.score("hybrid", budget, target_layers=target_layers, draft_layers=draft_layers, m=m)

    def oracle(self, budget: int) -> float:
        return self.score("oracle", budget)

    def streaming(self, budget: int) -> float:
        return self.score("streaming", budget)
