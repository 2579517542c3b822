"""The plots of lesson 4 (torchrun, agents and restarts), drawn from what the ranks recorded; each returns the matplotlib
Figure. Ranks keep their `[rank r]` colours (`output.RANK_COLORS`); the course's shared plots are in `ddp_helpers.course.plots`."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from ....output import rank_color
from ...plots import series_color


def plot_agents(ranks, title: str = "Which rank runs where"):
    """One box per torchrun agent ("machine"), holding its ranks: global rank, and local rank on that agent.

    Args:
        ranks: the run's RankResults (`run.ranks`), with `agent`, `group_rank` and `local_rank`.
    """
    agents = sorted({r.agent for r in ranks})
    per_agent = max(sum(1 for r in ranks if r.agent == a) for a in agents)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * per_agent, 1.0 + 1.1 * len(agents)))
    for row, agent in enumerate(agents):
        mine = sorted((r for r in ranks if r.agent == agent), key=lambda r: r.local_rank)
        group = mine[0].group_rank
        ax.add_patch(plt.Rectangle((-0.1, row - 0.45), per_agent + 0.2, 0.9, fill=False, linewidth=1.5))
        ax.text(-0.2, row, f"agent {agent}\n(GROUP_RANK {group})", ha="right", va="center", fontsize=8)
        for column, r in enumerate(mine):
            ax.add_patch(plt.Rectangle((column + 0.05, row - 0.35), 0.9, 0.7, color=rank_color(r.rank), alpha=0.9))
            ax.text(column + 0.5, row, f"RANK {r.rank}\nLOCAL_RANK {r.local_rank}", ha="center", va="center",
                    fontsize=8, color="white")
    ax.set_xlim(-1.6, per_agent + 0.2)
    ax.set_ylim(len(agents) - 0.5, -0.5)
    ax.axis("off")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def plot_steps_by_attempt(log: Sequence[dict], reference: Sequence[dict] | None = None, value: str = "loss",
                          by: str = "attempt", title: str = ""):
    """`value` per step, coloured by `by` (entries: {"step", value, by}: the attempt that ran the step, or
    the world size it ran at), with an uninterrupted run's values as a dashed line."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    if reference is not None:
        ax.plot([e["step"] for e in reference], [e[value] for e in reference], color="black", linestyle="--",
                linewidth=1, label="without a kill")
    for shade, group in enumerate(sorted({e[by] for e in log})):
        mine = [e for e in log if e[by] == group]
        ax.plot([e["step"] for e in mine], [e[value] for e in mine], "o", markersize=4, color=series_color(shade + 2),
                label=f"{by.replace('_', ' ')} {group}")
    ax.set_xlabel("step")
    ax.set_ylabel(value)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
