"""Teacher-forced attention traces over validation windows: what the ARR metrics and Algorithm 1 read.

For each window of `window` tokens (one validation document's prefix) the trace takes `steps` consecutive
verification steps with committed lengths L = L0 .. L0 + steps - 1 (L0 = window - Γ - steps, so the last step's
Γ+1 verification queries end at the window's last token). Per step it keeps, reduced layer by layer:

  truth          Ā^(w) of Eq. 3 with w = Γ+1: each measured target layer's SRH heads' attention of the verification
                 queries at L .. L+Γ on the selectable context [0, L), renormalised per head over [0, L), averaged
                 over heads and queries; then averaged over the measured layers (and kept per layer)
  target maps    per target layer, the SRH-summed probabilities of the queries at L0 - max_delta .. window - 1,
                 from which target history with look-back δ is Eq. 5 of the query at L - δ over j < L - δ
                 (δ = 1 is what the runtime scores: the last committed token)
  draft maps     per draft layer, S_draft of Eq. 5: the draft's SRH probabilities of its Γ lookahead queries at
                 L .. L+Γ-1 (teacher-forced: the drafted tokens are the document's tokens), summed over j < L
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trtllm_dustin.attention import AttentionBackend, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.data import split_documents
from trtllm_dustin.data.windows import token_windows
from trtllm_dustin.dustin_config import LayerHeads
from trtllm_dustin.models.decoder import Transformer
from trtllm_dustin.search.attention_probe import capture_queries

__all__ = ["AttentionTrace", "TraceSettings", "collect_trace", "validation_windows"]


@dataclass(frozen=True)
class TraceSettings:
    window: int = 4096  # tokens per validation window; committed lengths reach window - Γ - 1
    steps: int = 64  # verification steps per window (consecutive committed lengths)
    gamma: int = 3  # Γ: draft tokens per round; the ARR window is w = Γ + 1
    max_delta: int = 8  # the largest target look-back δ the trace supports
    documents: int = 4  # validation windows (one per document)
    sources: tuple[str, ...] = ("shakespeare", "essays_nvidia", "cpython_stdlib")  # corpora, taken in turn
    chunk: int = 1024  # prefill chunk

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        for name in ("steps", "gamma", "max_delta", "documents", "chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trace {name}={getattr(self, name)} must be >= 1")
        if self.first_length <= self.max_delta + 1:
            raise ConfigError(f"window {self.window} is too short for {self.steps} steps, Γ={self.gamma} and "
                              f"δ <= {self.max_delta}; raise --window or lower --steps")

    @property
    def first_length(self) -> int:
        """L0: the committed length of the first step."""
        return self.window - self.gamma - self.steps

    @property
    def captured(self) -> int:
        """Query positions captured per window: L0 - max_delta .. window - 1."""
        return self.steps + self.max_delta + self.gamma


@dataclass
class AttentionTrace:
    """Reduced teacher-forced attention of a target (and optionally a draft) over validation windows."""

    settings: TraceSettings
    doc_ids: tuple[str, ...]
    target_srh: tuple[LayerHeads, ...]  # the measured/scoring target layers and their SRHs
    draft_srh: tuple[LayerHeads, ...]  # the draft's scoring layers and SRHs (empty without a draft)
    seqlens: torch.Tensor  # int32 [R]: committed length L of each row (R = documents * steps)
    truth_by_layer: torch.Tensor  # fp32 [n_target_layers, R, S]: Ā^(w) per measured target layer
    target_maps: torch.Tensor  # fp32 [n_target_layers, documents, captured, S]: SRH-summed probabilities
    draft_maps: torch.Tensor | None  # fp32 [n_draft_layers, R, S]: S_draft per draft layer
    target_model: str = ""
    draft_model: str = ""

    @property
    def truth(self) -> torch.Tensor:
        """fp32 [R, S]: Ā^(w) averaged over the measured target layers (the search's ARR reference)."""
        return self.truth_by_layer.mean(0)

    def _layer_index(self, layers: Sequence[LayerHeads], layer: int) -> int:
        for i, lh in enumerate(layers):
            if lh.layer == layer:
                return i
        raise ConfigError(f"layer {layer} is not in the trace (layers {[lh.layer for lh in layers]})")

    def target_history(self, layers: Sequence[int], delta: int = 1) -> torch.Tensor:
        """fp32 [R, S]: S_target (Eq. 5) of the target's query at L - δ over j < L - δ, summed over `layers`."""
        s = self.settings
        if not 1 <= delta <= s.max_delta:
            raise ConfigError(f"look-back δ={delta} must lie in [1, {s.max_delta}] (the trace's max_delta)")
        start = s.max_delta - delta  # captured index of the query at L0 - δ
        maps = self.target_maps[[self._layer_index(self.target_srh, layer) for layer in layers]].sum(0)
        scores = maps[:, start: start + s.steps].reshape(-1, maps.shape[-1])  # [R, S]
        positions = torch.arange(scores.shape[1])
        return scores * (positions[None, :] < (self.seqlens.long() - delta)[:, None])

    def draft_lookahead(self, layers: Sequence[int]) -> torch.Tensor:
        """fp32 [R, S]: S_draft (Eq. 5) of the draft's Γ lookahead queries over j < L, summed over `layers`."""
        if self.draft_maps is None:
            raise ConfigError("this trace has no draft; collect it with a draft model and its SRH file")
        return self.draft_maps[[self._layer_index(self.draft_srh, layer) for layer in layers]].sum(0)

    def save(self, path: str | Path) -> None:
        torch.save({"settings": asdict(self.settings), "doc_ids": self.doc_ids,
                    "target_srh": [asdict(lh) for lh in self.target_srh],
                    "draft_srh": [asdict(lh) for lh in self.draft_srh], "seqlens": self.seqlens,
                    "truth_by_layer": self.truth_by_layer, "target_maps": self.target_maps,
                    "draft_maps": self.draft_maps, "target_model": self.target_model,
                    "draft_model": self.draft_model}, path)

    @classmethod
    def load(cls, path: str | Path) -> AttentionTrace:
        data = torch.load(path, weights_only=True)
        data["settings"] = TraceSettings(**data["settings"])
        data["doc_ids"] = tuple(data["doc_ids"])
        data["target_srh"] = tuple(LayerHeads(**lh) for lh in data["target_srh"])
        data["draft_srh"] = tuple(LayerHeads(**lh) for lh in data["draft_srh"])
        return cls(**data)

    def describe(self) -> str:
        return json.dumps({"settings": asdict(self.settings), "doc_ids": self.doc_ids,
                           "target_model": self.target_model, "draft_model": self.draft_model})


def validation_windows(tokenizer: object, settings: TraceSettings, split: str = "validation"
                       ) -> list[tuple[str, list[int]]]:
    """`documents` windows of `window` tokens from the split (the validation split unless told): the prefix of one
    document per work (two editions of a play would be near-copies), sources taken in turn."""
    per_source = []
    for source in settings.sources:
        seen: set[str] = set()
        documents = []
        for document in split_documents(split, [source]):
            if document.split_key not in seen:
                seen.add(document.split_key)
                documents.append(document)
        per_source.append(list(token_windows(documents, tokenizer, settings.window, max_per_document=1)))
    chosen: list[tuple[str, list[int]]] = []
    for i in range(max((len(w) for w in per_source), default=0)):
        for windows in per_source:
            if i < len(windows) and len(chosen) < settings.documents:
                chosen.append((windows[i].doc_id, list(windows[i].tokens)))
    if len(chosen) < settings.documents:
        raise ConfigError(f"the {split} split of {list(settings.sources)} has {len(chosen)} works of "
                          f"{settings.window}+ tokens, fewer than the {settings.documents} asked; lower --window or "
                          "--documents, or add sources")
    return chosen


def _step_context(settings: TraceSettings, S: int) -> torch.Tensor:
    """bool [steps, S]: the selectable context [0, L) of each step."""
    lengths = settings.first_length + torch.arange(settings.steps)
    return torch.arange(S)[None, :] < lengths[:, None]


def _truth(probs: torch.Tensor, settings: TraceSettings) -> torch.Tensor:
    """probs [D, captured, H, S] of one layer -> Ā^(w) [D * steps, S] (Eq. 3, renormalised over [0, L) per head)."""
    D, _, _, S = probs.shape
    context = _step_context(settings, S)
    total = torch.zeros(D, settings.steps, S)
    for s in range(settings.gamma + 1):  # the verification query at L + s
        start = settings.max_delta + s
        rows = probs[:, start: start + settings.steps] * context[None, :, None, :]  # [D, steps, H, S]
        total += (rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)).mean(2)
    return (total / (settings.gamma + 1)).reshape(D * settings.steps, S)


def _draft_scores(probs: torch.Tensor, settings: TraceSettings) -> torch.Tensor:
    """probs [D, captured, H, S] of one draft layer -> S_draft [D * steps, S]: Γ lookahead queries over j < L."""
    D, _, _, S = probs.shape
    context = _step_context(settings, S)
    total = torch.zeros(D, settings.steps, S)
    for s in range(settings.gamma):  # the lookahead query at L + s
        start = settings.max_delta + s
        total += probs[:, start: start + settings.steps].sum(2) * context[None]
    return total.reshape(D * settings.steps, S)


@torch.inference_mode()
def collect_trace(target: Transformer, target_srh: Sequence[LayerHeads], windows: Sequence[tuple[str, list[int]]],
                  settings: TraceSettings, draft: Transformer | None = None,
                  draft_srh: Sequence[LayerHeads] = (), backend: AttentionBackend | None = None,
                  progress: bool = True) -> AttentionTrace:
    """Run target (and draft) over the windows and reduce their SRH attention to an AttentionTrace."""
    backend = backend or get_backend("reference")
    if not target_srh:
        raise ConfigError("no target SRH layers given; profile the target with `trtllm-dustin srh` first")
    if draft is not None and not draft_srh:
        raise ConfigError("a draft was given without its SRH layers; profile it with `trtllm-dustin srh` first")
    if any(len(tokens) != settings.window for _, tokens in windows) or len(windows) != settings.documents:
        raise ConfigError(f"expected {settings.documents} windows of {settings.window} tokens")
    if settings.window > min(target.max_positions, draft.max_positions if draft is not None else target.max_positions):
        raise ConfigError(f"window {settings.window} exceeds the models' positions; lower --window")
    tokens = torch.tensor([t for _, t in windows], dtype=torch.long)
    seqlens = (settings.first_length + torch.arange(settings.steps)).repeat(settings.documents).to(torch.int32)
    S, n = settings.window, settings.captured
    truth = torch.zeros(len(target_srh), settings.documents * settings.steps, S)
    maps = torch.zeros(len(target_srh), settings.documents, n, S)
    draft_maps = torch.zeros(len(draft_srh), settings.documents * settings.steps, S) if draft is not None else None
    bar = tqdm(total=settings.documents * (len(target_srh) + len(draft_srh)), disable=not progress,
               desc="attention trace", unit="layer")
    for d in range(settings.documents):  # one window at a time keeps one cache in memory
        row = tokens[d: d + 1].to(target.embed.weight.device)
        captured = capture_queries(target, backend, row, [lh.layer for lh in target_srh], n, settings.chunk)
        for i, lh in enumerate(target_srh):
            probs = captured.attention(lh.layer, lh.heads).cpu()  # [1, n, H, S]
            maps[i, d] = probs[0].sum(1)
            truth[i, d * settings.steps: (d + 1) * settings.steps] = _truth(probs, settings)
            bar.update()
        del captured
        if draft is not None:
            captured = capture_queries(draft, backend, row.to(draft.embed.weight.device),
                                       [lh.layer for lh in draft_srh], n, settings.chunk)
            for i, lh in enumerate(draft_srh):
                probs = captured.attention(lh.layer, lh.heads).cpu()
                draft_maps[i, d * settings.steps: (d + 1) * settings.steps] = _draft_scores(probs, settings)
                bar.update()
            del captured
    bar.close()
    return AttentionTrace(settings, tuple(doc for doc, _ in windows), tuple(target_srh), tuple(draft_srh), seqlens,
                          truth, maps, draft_maps, target.config.name, draft.config.name if draft is not None else "")
