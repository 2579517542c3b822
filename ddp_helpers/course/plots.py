"""The plots several lessons share, drawn from what the ranks recorded (each lesson's own are in
`lessons/lessonN_plots.py`). Each rank has the same colour as its
`[rank r]` output prefix (see `output.RANK_COLORS`). Every function returns the matplotlib Figure."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..output import RANK_COLORS, rank_color

# Series that are not ranks (strategies, kinds of collective, attempts, world sizes): colours no rank
# uses, so that a colour always means the same rank across the course.
SERIES_COLORS = ("#3b3b3b", "#a0a0a0", "#b8860b", "#006d6f", "#6a3d6a", "#8b4513", "#5f7f3f", "#c0a0c0")
assert not set(SERIES_COLORS) & set(RANK_COLORS)


def series_color(index: int) -> str:
    return SERIES_COLORS[index % len(SERIES_COLORS)]



def plot_loss_per_rank(losses: Sequence[Sequence[float]], title: str = "Training loss on each rank"):
    """One line per rank: the loss of each step on that rank's own batches."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for rank, values in enumerate(losses):
        ax.plot(values, color=rank_color(rank), label=f"rank {rank}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_bytes_per_rank(per_rank: Sequence[dict[str, int]], title: str):
    """Stacked bars: per rank, the bytes of each kind (parameters, gradients, optimizer state, ...)."""
    fig, ax = plt.subplots(figsize=(6, 3))
    kinds = list(per_rank[0])
    bottoms = np.zeros(len(per_rank))
    for shade, kind in enumerate(kinds):
        values = np.array([r[kind] for r in per_rank]) / 2**20
        ax.bar(range(len(per_rank)), values, bottom=bottoms, color=[rank_color(r) for r in range(len(per_rank))],
               alpha=1.0 - 0.3 * shade, edgecolor="white", label=kind)
        for r, (b, v) in enumerate(zip(bottoms, values)):
            ax.text(r, b + v / 2, f"{kind}\n{v:.1f} MiB", ha="center", va="center", fontsize=7)
        bottoms += values
    ax.set_xticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_bars(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str):
    """One bar per label (e.g. bytes communicated per step by each way of splitting), log scale."""
    fig, ax = plt.subplots(figsize=(6, 2.8))
    bars = ax.bar(range(len(labels)), values, color="#7f7f7f")
    ax.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(values) * 4)  # room above the tallest bar for its label
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_series_per_rank(panels: dict[str, Sequence[Sequence[float]]], reference: Sequence[float] | None = None,
                         reference_label: str = "", ylabel: str = "", title: str = ""):
    """Side-by-side panels, one line per rank (e.g. a running statistic over steps), and an optional dashed
    reference line drawn in every panel."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False, sharey=True)
    for ax, (panel_title, per_rank) in zip(axes[0], panels.items()):
        for rank, values in enumerate(per_rank):
            ax.plot(values, color=rank_color(rank), label=f"rank {rank}")
        if reference is not None:
            ax.plot(reference, color="black", linestyle="--", linewidth=1, label=reference_label)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


