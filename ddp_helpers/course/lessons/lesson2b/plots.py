"""Deep dive 2b's plot: where each gradient bucket's all-reduce starts within one backward()."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ....output import rank_color


def plot_all_reduce_timeline(timelines: Sequence[dict], title: str = "One backward() on each rank"):
    """Per rank, the backward pass as a bar, and a marker where each gradient bucket's all-reduce was
    started (from a communication hook), labelled with the bucket's size.

    Args:
        timelines: per rank, {"backward_ms": total, "buckets": [{"bucket": i, "bytes": n, "at": ms}, ...]}
            with times in milliseconds from the start of that backward().
    """
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.7 * len(timelines)))
    for rank, timeline in enumerate(timelines):
        ax.barh(rank, timeline["backward_ms"], height=0.35, color=rank_color(rank), alpha=0.35)
        for bucket in timeline["buckets"]:
            ax.plot(bucket["at"], rank, "v", color=rank_color(rank), markersize=10)
            ax.annotate(f"bucket {bucket['bucket']}\n{bucket['bytes'] / 1024:.0f} KiB", (bucket["at"], rank - 0.25),
                        ha="center", va="bottom", fontsize=7)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.set_ylim(len(timelines) - 0.5, -0.9)
    ax.set_xlabel("ms from the start of backward() (bar: the whole call, which waits for the last all-reduce)")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig
