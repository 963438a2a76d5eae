"""ARR vs output distortion (paper Appendix B): does keeping more attention mass keep the logits closer?

Per prompt: greedily generate `new_tokens` with the full cache, then replay that fixed token sequence teacher-forced
(one forward over all of it), once with the full cache (reference logits and queries) and once per sampled KV subset
of the prompt with the sparse backend path (`AttentionMetadata.indices`; the generated tokens stay visible). A subset
is 4 sinks + 16 recent + k - 20 positions drawn by Gumbel-top-k over τ·log Ā: τ > 0 favours high-attention positions,
τ = 0 is uniform, τ < 0 favours low-attention ones, so the subsets span a wide range of ARR. For each subset, ARR
(Eq. 1 against the full run's attention on the prompt, averaged over the generated steps, over all heads and over
the SRHs) and KL(p_full || p_sparse) (Eq. 8, averaged over steps) form one point; the result is their Pearson
correlation (the paper: -0.95 on Llama-3.1-8B, -0.81 on Qwen2.5-7B).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.dustin_config import LayerHeads
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.runtime.prefill import prefill
from trtllm_dustin.search.attention_probe import head_attention

__all__ = ["ARRKLPoint", "ARRKLSettings", "arr_kl_points", "pearson", "summarise"]


@dataclass(frozen=True)
class ARRKLSettings:
    budget: int = 512  # k, sinks and window included (the paper's setting)
    n_sink: int = 4
    n_recent: int = 16
    new_tokens: int = 32  # greedy tokens generated and replayed per prompt
    temperatures: tuple[float, ...] = (-4.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 16.0)  # τ of the subset sampler
    samples_per_temperature: int = 2
    seed: int = 0
    chunk: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if self.budget <= self.n_sink + self.n_recent:
            raise ConfigError(f"budget {self.budget} must exceed sinks + window = {self.n_sink + self.n_recent}")
        if self.new_tokens < 1 or self.samples_per_temperature < 1 or not self.temperatures:
            raise ConfigError("new_tokens, samples_per_temperature and temperatures must be positive / non-empty")


@dataclass(frozen=True)
class ARRKLPoint:
    prompt: int  # index of the prompt
    temperature: float  # τ of the sampler that drew the subset
    arr_all: float  # ARR over all heads of all layers, mean over generated steps
    arr_srh: float  # ARR over the SRHs only (NaN without SRHs)
    kl: float  # mean over generated steps of KL(p_full || p_sparse), nats


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation coefficient of two equally long samples (NaN when either is constant)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"pearson needs two samples of equal length >= 2, got {len(x)} and {len(y)}")
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    denominator = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum()) / denominator if denominator > 0 else float("nan")


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """[T]: KL(softmax p || softmax q) per row."""
    log_p, log_q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _subset(score: torch.Tensor, length: int, settings: ARRKLSettings, temperature: float,
            generator: torch.Generator) -> torch.Tensor:
    """int32 [1, k]: sinks + recent + Gumbel-top-k of τ·log(score) over the rest of [0, length)."""
    protected = list(range(settings.n_sink)) + list(range(length - settings.n_recent, length))
    middle = torch.arange(settings.n_sink, length - settings.n_recent)
    gumbel = -torch.log(-torch.log(torch.rand(len(middle), generator=generator, dtype=torch.float64)))
    keys = temperature * torch.log(score[middle].double() + 1e-12) + gumbel
    picked = middle[torch.topk(keys, settings.budget - len(protected)).indices]
    return torch.tensor(sorted(protected + picked.tolist()), dtype=torch.int32)[None, :]


@torch.inference_mode()
def arr_kl_points(model: Transformer, prompts: Sequence[Sequence[int]], settings: ARRKLSettings,
                  srh: Sequence[LayerHeads] = (), backend: AttentionBackend | None = None,
                  progress: bool = True) -> list[ARRKLPoint]:
    """Sample KV subsets of each prompt, replay the greedy continuation sparsely, return (ARR, KL) points."""
    backend = backend or get_backend("reference")
    config = model.config
    device = model.embed.weight.device
    layers = tuple(range(config.num_layers))
    generator = torch.Generator().manual_seed(settings.seed)
    points: list[ARRKLPoint] = []
    subsets = len(settings.temperatures) * settings.samples_per_temperature
    bar = tqdm(total=len(prompts) * subsets, desc="ARR-KL replays", disable=not progress, unit="subset")
    for p, prompt in enumerate(prompts):
        L, T = len(prompt), settings.new_tokens
        if L <= settings.budget:
            raise ConfigError(f"prompt {p} has {L} tokens, not more than the budget {settings.budget}; nothing to drop")
        cache = KVCache.allocate(config, 1, L + T, model.embed.weight.dtype, device)
        logits, _ = prefill(model, cache, backend, [list(prompt)], chunk=settings.chunk)
        generated = []
        for _ in range(T):  # the greedy continuation the replays share
            token = logits.argmax(-1)
            generated.append(int(token[0]))
            logits = model(token[:, None], cache, AttentionMetadata(cache_seqlens=cache.seqlens), backend,
                           logit_index=torch.zeros(1, dtype=torch.long, device=device))
            cache.seqlens.add_(1)
        tokens = torch.tensor([generated], device=device)
        cache.seqlens.fill_(L)
        buffers = {layer: torch.empty(1, T, config.num_heads, config.head_dim, dtype=cache.k.dtype, device=device)
                   for layer in layers}
        full = model(tokens, cache, AttentionMetadata(cache_seqlens=cache.seqlens), backend,
                     capture=QueryCapture(layers, buffers))[0]  # [T, V]
        positions = (L + torch.arange(T, device=device))[None, :]
        attn_all = torch.zeros(L, dtype=torch.float64)  # Σ over layers, heads, steps of renormalised prompt attention
        attn_srh = torch.zeros(L, dtype=torch.float64)
        srh_heads = {lh.layer: set(lh.heads) for lh in srh}
        for layer in layers:  # one layer's probabilities at a time
            probs = head_attention(buffers[layer], cache.k[layer], positions)[0, :, :, :L]  # [T, H, L]
            probs = (probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)).double().cpu()
            attn_all += probs.sum((0, 1))
            for h in srh_heads.get(layer, ()):
                attn_srh += probs[:, h].sum(0)
        n_srh = T * sum(len(h) for h in srh_heads.values())
        attn_all /= T * config.num_layers * config.num_heads
        attn_srh = attn_srh / n_srh if n_srh else attn_srh
        for temperature in settings.temperatures:
            for _ in range(settings.samples_per_temperature):
                indices = _subset(attn_all, L, settings, temperature, generator)
                cache.seqlens.fill_(L)
                sparse = model(tokens, cache, AttentionMetadata(cache_seqlens=cache.seqlens,
                                                                indices=indices.to(device)), backend)[0]
                kept = indices[0].long()
                points.append(ARRKLPoint(p, temperature, float(attn_all[kept].sum()),
                                         float(attn_srh[kept].sum()) if n_srh else float("nan"),
                                         float(_kl(full, sparse).mean())))
                bar.update()
    bar.close()
    return points


def summarise(points: Sequence[ARRKLPoint]) -> dict[str, object]:
    """Pearson correlations (all heads, SRHs) pooled over prompts and per prompt, with the points."""
    prompts = sorted({pt.prompt for pt in points})
    summary: dict[str, object] = {
        "pearson_arr_all_vs_kl": pearson([pt.arr_all for pt in points], [pt.kl for pt in points]),
        "pearson_arr_srh_vs_kl": pearson([pt.arr_srh for pt in points], [pt.kl for pt in points])
        if not any(math.isnan(pt.arr_srh) for pt in points) else float("nan"),
        "per_prompt_pearson_arr_all_vs_kl": [pearson([pt.arr_all for pt in points if pt.prompt == p],
                                                     [pt.kl for pt in points if pt.prompt == p]) for p in prompts],
    }
    summary["points"] = [asdict(pt) for pt in points]
    return summary
