"""The plots of lesson 7 (build DDP yourself); each returns the matplotlib Figure. Ranks keep their `[rank r]`
colours (`output.RANK_COLORS`); series that are not ranks use `plots.series_color`."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from ....output import rank_color
from ...plots import series_color
from ..lesson6 import human_bytes


def plot_overlap(per_rank: list[tuple[list, list, list[dict]]]):
    """Per rank, its last step: the backward (a bar, from its start until backward() returned), when each
    all-reduce started (a tick, the flight recorder's clock) and when the wait for them ended (a diamond)."""
    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.0 * len(per_rank)))
    for rank, (backward_ns, waited_ns, calls) in enumerate(per_rank):
        start, end = backward_ns[-1]
        waited = waited_ns[-1]
        ax.barh(rank, (end - start) / 1e6, height=0.35, color=rank_color(rank), alpha=0.35,
                label="the backward" if rank == 0 else None)
        ticks = [(c["started_ns"] - start) / 1e6 for c in calls if start <= c["started_ns"] <= waited]
        ax.plot(ticks, [rank] * len(ticks), "|", color=rank_color(rank), markersize=16, markeredgewidth=1.5,
                label="an all-reduce starts" if rank == 0 else None)
        ax.plot([(waited - start) / 1e6], [rank], "D", color=series_color(1), markersize=6,
                label="every all-reduce waited for" if rank == 0 else None)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.set_ylim(len(per_rank) - 0.4, -0.6)
    ax.set_xlabel("ms from the start of the last step's backward()")
    ax.set_title("Overlap: each gradient's all-reduce starts inside the backward", fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    fig.tight_layout()
    return fig


def plot_bucket_sweep(rows: list[dict]):
    """Per bucket cap: the step's median time and the all-reduces a step, yours beside torch DDP's."""
    labels = [human_bytes(row["cap"]) for row in rows]
    positions = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, (mine, theirs, label) in ((left, ("mine_ms", "torch_ms", "step time (ms, median)")),
                                      (right, ("mine", "theirs", "all-reduces a step"))):
        ax.bar([p - 0.2 for p in positions], [row[mine] for row in rows], width=0.4, color=series_color(0),
               label="yours (after the backward)")
        ax.bar([p + 0.2 for p in positions], [row[theirs] for row in rows], width=0.4, color=series_color(1),
               label="torch DDP (inside the backward)")
        ax.set_xticks(list(positions), labels)
        ax.set_xlabel("bucket cap")
        ax.set_ylabel(label)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.legend(fontsize=8, frameon=False)
    fig.suptitle("Buckets: the same bytes in fewer, larger all-reduces (rank 0)", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig
