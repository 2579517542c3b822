"""The course's plots, drawn from what the ranks recorded. Each rank has the same colour as its
`[rank r]` output prefix (see `output.RANK_COLORS`). Every function returns the matplotlib Figure."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from .output import RANK_COLORS, rank_color

# Series that are not ranks (strategies, kinds of collective, attempts, world sizes): colours no rank
# uses, so that a colour always means the same rank across the course.
SERIES_COLORS = ("#3b3b3b", "#a0a0a0", "#b8860b", "#006d6f", "#6a3d6a", "#8b4513", "#5f7f3f", "#c0a0c0")
assert not set(SERIES_COLORS) & set(RANK_COLORS)


def series_color(index: int) -> str:
    return SERIES_COLORS[index % len(SERIES_COLORS)]

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
    fig, axes = plt.subplots(1, panels, figsize=(max(4.0, 3.2 * panels), 3.2), squeeze=False, sharey=True)
    for ax, per_rank, title in zip(axes[0], partitions, titles):
        world = len(per_rank)
        for rank, indices in enumerate(per_rank):
            for position, index in enumerate(indices):
                ax.add_patch(plt.Rectangle((index, rank - 0.4), 0.9, 0.8, color=rank_color(rank), alpha=0.85))
                ax.text(index + 0.45, rank, str(position), ha="center", va="center", fontsize=7, color="white")
        counts = np.bincount([i for indices in per_rank for i in indices], minlength=dataset_size)
        for index in np.flatnonzero(counts > 1):
            ax.annotate("\u00d7%d" % counts[index], (index + 0.45, world - 0.45), ha="center", fontsize=7, color="black")
        ax.set_xlim(0, dataset_size)
        ax.set_ylim(world - 0.4 + 0.5, -0.9)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.set_xticks(range(0, dataset_size, max(1, dataset_size // 10)))
        ax.set_title(title, fontsize=10)
    world = max(len(p) for p in partitions)
    fig.suptitle(suptitle, x=0.02, ha="left")
    fig.legend(
        handles=[Patch(color=rank_color(r), label=f"rank {r}") for r in range(world)],
        loc="upper left", bbox_to_anchor=(0.01, 0.92), ncol=min(world, 8), fontsize=8, frameon=False,
    )
    fig.supxlabel("dataset index (the number in a cell: its position in that rank's order; \u00d7n: seen n times)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.84))
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


def plot_memory_and_communication(worlds: Sequence[int], largest_share_mib: dict[str, Sequence[float]],
                                  received_per_step: dict[str, dict[str, float]]):
    """Left: per strategy, the bytes the fullest rank holds at each world size. Right: per strategy, the
    bytes one rank receives through each kind of collective in one training step."""
    fig, (memory, traffic) = plt.subplots(1, 2, figsize=(10, 3.4))
    width = 0.8 / len(largest_share_mib)
    for i, (strategy, values) in enumerate(largest_share_mib.items()):
        positions = np.arange(len(worlds)) + (i - (len(largest_share_mib) - 1) / 2) * width
        memory.bar(positions, values, width, label=strategy, color=series_color(i))
    memory.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
    memory.set_ylabel("MiB on the fullest rank")
    memory.set_title("Training state per rank (parameters, gradients, Adam)", fontsize=9)
    memory.set_ylim(0, max(max(v) for v in largest_share_mib.values()) * 1.3)  # room for the legend
    memory.legend(fontsize=8)
    kinds = sorted({kind for per_kind in received_per_step.values() for kind in per_kind})
    bottoms = np.zeros(len(received_per_step))
    for shade, kind in enumerate(kinds):
        values = np.array([per_kind.get(kind, 0) for per_kind in received_per_step.values()]) / 2**20
        traffic.bar(range(len(received_per_step)), values, bottom=bottoms, label=kind, color=series_color(shade + 2))
        bottoms += values
    traffic.set_xticks(range(len(received_per_step)), list(received_per_step))
    traffic.set_ylabel("MiB received by a rank")
    traffic.set_title("Communication in one step", fontsize=9)
    traffic.set_ylim(0, bottoms.max() * 1.35)  # the tallest bar stays clear of the frame and the legend
    traffic.legend(fontsize=8)
    fig.tight_layout()
    return fig


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
