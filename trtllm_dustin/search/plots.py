"""PNG plots of the offline search (matplotlib, Agg): ARR vs budget (paper Fig. 2-4), layer-wise ARR, ARR vs KL,
SRH score heat maps. Each takes plain numbers, so a plot can be redrawn from a committed JSON."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["plot_arr_kl", "plot_arr_vs_budget", "plot_layerwise", "plot_srh_scores"]

_STYLE = {"oracle": ("black", "-", "SD oracle (Eq. 3)"), "hybrid": ("tab:red", "-", "hybrid (Eq. 6)"),
          "draft_lookahead": ("tab:green", "-", "draft lookahead"), "streaming": ("tab:gray", ":", "StreamingLLM")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(ax, title: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    _pyplot().close(fig)
    return path


def plot_arr_vs_budget(budgets: Sequence[int], curves: Mapping[str, Sequence[float]], path: str | Path,
                       title: str) -> Path:
    """curves: policy -> ARR per budget; policies named target_history_d<δ> get one blue shade per δ."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    history = sorted((n for n in curves if n.startswith("target_history")), key=lambda n: int(n.rsplit("d", 1)[1]))
    blues = plt.cm.Blues([0.9 - 0.5 * i / max(1, len(history) - 1) for i in range(len(history))])
    for name, values in curves.items():
        if name in history:
            color, style, label = blues[history.index(name)], "--", f"target history δ={name.rsplit('d', 1)[1]}"
        else:
            color, style, label = _STYLE.get(name, ("tab:purple", "-", name))
        ax.plot(budgets, values, style, color=color, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(budgets), [str(b) for b in budgets])
    ax.set_xlabel("KV cache budget k (tokens)")
    ax.set_ylabel("windowed ARR (Eq. 4)")
    _title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_layerwise(series: Mapping[str, tuple[Sequence[int], Sequence[float], int]], path: str | Path,
                   title: str) -> Path:
    """series: label -> (layer indices, ARR per layer, that model's layer count); x is relative depth."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    colors = {"T": "tab:blue", "D": "tab:green", "H": "tab:red"}
    for label, (layers, values, num_layers) in series.items():
        depth = [layer / max(1, num_layers - 1) for layer in layers]
        ax.plot(depth, values, "-o", markersize=3, color=colors.get(label[:1], None), label=label)
    ax.set_xlabel("relative layer depth (layer / (layers - 1)) of the scoring layer")
    ax.set_ylabel("windowed ARR (Eq. 4)")
    _title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_arr_kl(arr: Sequence[float], kl: Sequence[float], path: str | Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.0))
    ax.scatter(arr, kl, s=12, alpha=0.8)
    ax.set_xlabel("ARR (all heads, mean over generated steps)")
    ax.set_ylabel("KL(p_full || p_sparse), nats")
    ax.set_yscale("log")
    _title(ax, title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_srh_scores(scores: Sequence[Sequence[float | None]], path: str | Path, title: str) -> Path:
    """scores [layer][head] (None = undefined) as a heat map."""
    plt = _pyplot()
    grid = [[float("nan") if x is None else x for x in row] for row in scores]
    fig, ax = plt.subplots(figsize=(4.8, max(3.0, 0.18 * len(grid) + 1.2)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="mean needle mass per counted test")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    _title(ax, title)
    return _save(fig, path)
