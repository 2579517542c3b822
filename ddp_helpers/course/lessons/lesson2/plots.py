"""The plots of lesson 2 (DDP basics), drawn from what the ranks recorded; each returns the matplotlib
Figure. Ranks keep their `[rank r]` colours (`output.RANK_COLORS`); the course's shared plots are in `ddp_helpers.course.plots`."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ....output import rank_color

# Log axes cannot show 0: exact zeros (bitwise equal) are drawn as a short stub at this floor, marked "0".
_ZERO_FLOOR = 1e-12


def plot_partitions(
    partitions: Sequence[Sequence[Sequence[int]]],
    dataset_size: int,
    titles: Sequence[str],
    suptitle: str = "Which samples each rank sees",
):
    """One panel per partition: a grid of the data set's indices, each cell coloured by the rank(s) that
    got it. Row = position in the rank's order, so changes of order across epochs show too.

    Args:
        partitions: per panel, per rank, the list of indices that rank iterates over, in order.
        dataset_size: number of samples in the data set (indices 0 .. dataset_size-1).
        titles: one title per panel (e.g. "epoch 0").
    """
    panels = len(partitions)
    repeated = False
    fig, axes = plt.subplots(1, panels, figsize=(max(6.0, 3.2 * panels), 3.2), squeeze=False, sharey=True)
    for ax, per_rank, title in zip(axes[0], partitions, titles):
        world = len(per_rank)
        for rank, indices in enumerate(per_rank):
            for position, index in enumerate(indices):
                ax.add_patch(plt.Rectangle((index, rank - 0.4), 0.9, 0.8, color=rank_color(rank), alpha=0.85))
                ax.text(index + 0.45, rank, str(position), ha="center", va="center", fontsize=8, color="white",
                        fontweight="bold")
        counts = np.bincount([i for indices in per_rank for i in indices], minlength=dataset_size)
        for index in np.flatnonzero(counts > 1):
            repeated = True
            ax.annotate("\u00d7%d" % counts[index], (index + 0.45, world - 0.45), ha="center", fontsize=7, color="black")
        ax.set_xlim(0, dataset_size)
        ax.set_ylim(world - 0.4 + 0.5, -0.9)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        shown = range(0, dataset_size, 1 if dataset_size <= 16 else max(1, dataset_size // 10))
        ax.set_xticks([index + 0.45 for index in shown], [str(index) for index in shown], fontsize=8)  # under each cell
        ax.set_title(title, fontsize=10)
    world = max(len(p) for p in partitions)
    fig.suptitle(suptitle, x=0.02, ha="left")
    fig.legend(
        handles=[Patch(color=rank_color(r), label=f"rank {r}") for r in range(world)],
        loc="upper left", bbox_to_anchor=(0.01, 0.93), ncol=min(world, 8), fontsize=8, frameon=False,
    )
    fig.supxlabel("dataset index (the number in a cell: its position in that rank's order"
                  + ("; \u00d7n: seen n times)" if repeated else ")"), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    return fig


def plot_gradient_agreement(
    parameter_names: Sequence[str],
    series: dict[str, Sequence[float]],
    tolerance: float | None = None,
    title: str = "Gradient agreement per parameter",
):
    """Per parameter, the largest absolute difference of each comparison, on a log scale. Exact zeros
    (bitwise equal) sit on the floor line labelled so.

    Args:
        parameter_names: x axis labels.
        series: label -> one max-abs-difference per parameter, e.g.
            {"local gradients, across ranks": [...], "DDP gradients, across ranks": [...]}.
        tolerance: drawn as a dashed line (e.g. PyTorch's own test tolerance).
    """
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = np.arange(len(parameter_names))
    width = 0.8 / len(series)
    styles = ["#7f7f7f", "#2ca02c", "#9467bd", "#8c564b"]
    for i, (label, values) in enumerate(series.items()):
        values = np.asarray(values, dtype=float)
        positions = x + (i - (len(series) - 1) / 2) * width
        color = styles[i % len(styles)]
        ax.bar(positions, np.maximum(values, _ZERO_FLOOR * 3), width, label=label, color=color, bottom=_ZERO_FLOOR)
        for position, value in zip(positions, values):
            if value == 0:
                ax.text(position, _ZERO_FLOOR * 6, "0", ha="center", va="bottom", fontsize=9, fontweight="bold", color=color)
    ax.set_yscale("log")
    if tolerance is not None:
        ax.axhline(tolerance, color="red", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g}")
    ax.set_xticks(x, parameter_names, rotation=20, ha="right")
    ax.set_ylabel("largest |difference|  (0 = bitwise equal)")
    ax.set_ylim(_ZERO_FLOOR, None)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_weights_per_rank(panels: dict[str, Sequence[Sequence[float]]], title: str):
    """Side-by-side panels of a few weights per rank, e.g. before and after the DDP wrap.

    Args:
        panels: panel title -> per rank, a short list of weight values.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.0), sharey=True, squeeze=False)
    for ax, (panel_title, per_rank) in zip(axes[0], panels.items()):
        world = len(per_rank)
        for rank, values in enumerate(per_rank):
            positions = np.arange(len(values)) + (rank - (world - 1) / 2) * (0.8 / world)
            ax.bar(positions, values, 0.8 / world, color=rank_color(rank), label=f"rank {rank}")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("weight index")
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0][0].set_ylabel("value")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, x=0.02, ha="left")
    fig.tight_layout()
    return fig
