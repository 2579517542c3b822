"""The plots of lesson 1 (pipeline schedules), drawn from what the ranks recorded; each returns the matplotlib
Figure. Ranks keep their `[rank r]` colours (`output.RANK_COLORS`); the course's shared plots are in `ddp_helpers.course.plots`."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ....output import rank_color


def plot_pipeline_timelines(timelines: dict[str, Sequence[dict]], title: str = "What each stage does, when"):
    """One panel per schedule: per rank, a box for each forward (solid) and backward (hatched) piece.

    Args:
        timelines: {panel title: per rank {"pieces": [{"kind", "micro", "start", "end"}], "total": s}}.
    """
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.2 + 1.3 * len(timelines)), squeeze=False)
    for ax, (name, timeline) in zip(axes[:, 0], timelines.items()):
        for rank, per_rank in enumerate(timeline):
            for piece in per_rank["pieces"]:
                ms = (piece["start"] * 1e3, (piece["end"] - piece["start"]) * 1e3)
                ax.broken_barh([ms], (rank - 0.35, 0.7), facecolors=rank_color(rank),
                               alpha=0.9 if piece["kind"] == "forward" else 0.5,
                               hatch=None if piece["kind"] == "forward" else "//", edgecolor="white")
        ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
        ax.set_ylim(len(timeline) - 0.5, -0.5)
        ax.set_xlim(0, max(r["total"] for r in timeline) * 1e3)
        ax.set_title(name, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms (solid: forward of a micro-batch, hatched: its backward; white space: idle)")
    fig.suptitle(title, x=0.02, ha="left")
    fig.tight_layout()
    return fig


def plot_idle_fraction(micro_batches: Sequence[int], measured: Sequence[Sequence[float]], formula: Sequence[float]):
    """Measured idle fraction per rank against the formula, for each number of micro-batches."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for rank in range(len(measured[0])):
        ax.plot(micro_batches, [m[rank] for m in measured], "o-", color=rank_color(rank), label=f"rank {rank}, measured")
    ax.plot(micro_batches, formula, "k--", label="(p - 1) / (m + p - 1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(micro_batches), [str(m) for m in micro_batches])
    ax.set_xlabel("micro-batches m (p = 2 stages)")
    ax.set_ylabel("idle fraction")
    ax.set_ylim(0, 0.7)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
