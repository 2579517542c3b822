"""The plots of lesson 6 (is it fast?); each returns the matplotlib Figure. Ranks keep their `[rank r]`
colours (`output.RANK_COLORS`); series that are not ranks use `plots.series_color`."""

from __future__ import annotations

import matplotlib.pyplot as plt

from ....output import rank_color
from ...plots import series_color
from . import PLAYBOOK_CONDITIONS, PLAYBOOK_DP_SCALING, PUBLISHED_BUS_BANDWIDTH, AlphaBeta, bandwidths, ring_factor


def plot_allreduce(points: list[dict], world_size: int, fit: AlphaBeta, published: bool = False):
    """Time and bus bandwidth against payload, measured and as the fitted model predicts (log-log)."""
    measured = bandwidths(points, world_size)
    sizes = [p["bytes"] for p in measured]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.loglog(sizes, [p["seconds"] * 1e6 for p in measured], "o", color=series_color(0), label="measured")
    left.loglog(sizes, [fit.predict(s) * 1e6 for s in sizes], "-", color=series_color(1),
                label=f"alpha + bytes / beta ({fit.alpha_s * 1e6:.0f} us, {fit.beta_bytes_per_s / 1e9:.2f} GB/s)")
    left.set_xlabel("payload (bytes)")
    left.set_ylabel("time (us)")
    left.legend(fontsize=8, frameon=False)
    right.semilogx(sizes, [p["busbw"] / 1e9 for p in measured], "o-", color=series_color(0), label="measured")
    right.semilogx(sizes, [s / fit.predict(s) * ring_factor(world_size) / 1e9 for s in sizes], "-",
                   color=series_color(1), label="model")
    if published:  # someone else's hardware, for scale: horizontal lines, labelled
        for index, (label, busbw, _source) in enumerate(PUBLISHED_BUS_BANDWIDTH):
            right.axhline(busbw / 1e9, color=series_color(2 + index), linestyle=":", label=f"{label} (published)")
        right.set_yscale("log")
    right.set_xlabel("payload (bytes)")
    right.set_ylabel("bus bandwidth (GB/s)")
    right.legend(fontsize=7, frameon=False, loc="lower right")
    fig.suptitle(f"all_reduce on {world_size} ranks", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def plot_step_timeline(facts_per_rank: list[dict], title: str = "One backward() with DDP, on each rank"):
    """Per rank: the backward without communication (no_sync), the backward with DDP (medians), and each
    bucket's all-reduce from its launch (the hook) to its result, one thin line per bucket, in one repetition:
    rank 0's median one, the same repetition on every rank."""
    import statistics

    ddp_times = facts_per_rank[0]["ddp_s"]
    shown = ddp_times.index(statistics.median_low(ddp_times))

    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.3 * len(facts_per_rank)))
    for rank, facts in enumerate(facts_per_rank):
        ax.barh(rank - 0.3, statistics.median(facts["ddp_s"]) * 1e3, height=0.16, color=rank_color(rank), alpha=0.35,
                label="backward with DDP" if rank == 0 else None)
        ax.barh(rank - 0.12, statistics.median(facts["compute_s"]) * 1e3, height=0.16, color=series_color(0),
                alpha=0.5, label="backward under no_sync (compute only)" if rank == 0 else None)
        buckets = facts["timelines"][shown]
        for index, (launched, done, _size) in enumerate(buckets):
            y = rank + 0.05 + 0.3 * index / max(1, len(buckets) - 1)
            ax.plot([launched * 1e3, done * 1e3], [y, y], "-", color=rank_color(rank), linewidth=1.6,
                    label="each bucket's all-reduce, launch to callback" if rank == 0 and index == 0 else None)
    ax.set_yticks(range(len(facts_per_rank)), [f"rank {r}" for r in range(len(facts_per_rank))])
    ax.set_ylim(len(facts_per_rank) - 0.55, -0.5)
    ax.set_xlabel("ms from the start of backward() (bars: medians over the repetitions; lines: one of them)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3)
    fig.tight_layout()
    return fig


def plot_bucket_sweep(sweep: dict[str, dict]):
    """Step time and all-reduces per step for each bucket_cap_mb."""
    import statistics

    labels = list(sweep)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.bar(labels, [statistics.median(v["ddp_s"]) * 1e3 for v in sweep.values()], color=series_color(0))
    left.set_ylabel("backward with DDP (ms, median)")
    right.bar(labels, [v["allreduces"] for v in sweep.values()], color=series_color(1))
    right.set_ylabel("all-reduces per step")
    for ax in (left, right):
        ax.set_xlabel("bucket_cap_mb")
    fig.suptitle("Buckets: fewer, larger all-reduces, or more, smaller ones that start sooner", fontsize=10,
                 x=0.01, ha="left")
    fig.tight_layout()
    return fig


def plot_compression(variants: dict[str, dict]):
    """Bytes per step and the loss over the steps, for each communication hook."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    names = list(variants)
    left.barh(names, [v["bytes_per_step"][-1] for v in variants.values()], color=series_color(0))
    left.set_xscale("log")
    left.set_xlabel("bytes all-reduced in the last step (counted)")
    left.invert_yaxis()
    for index, (name, v) in enumerate(variants.items()):
        right.plot(v["losses"], color=series_color(index), label=name)
    right.set_xlabel("step")
    right.set_ylabel("loss on rank 0's batch")
    right.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_scaling(throughput: dict[int, float]):
    """Samples per second at each world size, against perfect scaling from one rank."""
    worlds = sorted(throughput)
    one = throughput[worlds[0]] / worlds[0]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(worlds, [throughput[w] for w in worlds], "o-", color=series_color(0), label="measured")
    ax.plot(worlds, [one * w for w in worlds], ":", color=series_color(1), label="perfect scaling")
    ax.set_xticks(worlds)
    ax.set_xlabel("ranks")
    ax.set_ylabel("samples per second")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_scaling_beside_the_playbook(efficiency: dict[int, float]):
    """Left, this run's scaling efficiency per world size; right, the Playbook's tokens/s per GPU, relative to
    8 GPUs, on 8 to 256 H100s (PLAYBOOK_DP_SCALING, with its conditions)."""
    fig, (mine, theirs) = plt.subplots(1, 2, figsize=(10, 3.4))
    worlds = sorted(efficiency)
    mine.plot(worlds, [efficiency[w] for w in worlds], "o-", color=series_color(0))
    mine.set_xticks(worlds)
    mine.set_ylim(0, 1.1)
    mine.set_xlabel("ranks (this machine)")
    mine.set_ylabel("scaling efficiency")
    mine.set_title("Your run: weak scaling (the batch per rank fixed)", fontsize=10, loc="left")
    gpus = sorted(PLAYBOOK_DP_SCALING)
    first = PLAYBOOK_DP_SCALING[gpus[0]][0]
    theirs.plot(gpus, [PLAYBOOK_DP_SCALING[g][0] / first for g in gpus], "o-", color=series_color(1))
    theirs.set_xscale("log", base=2)
    theirs.set_xticks(gpus, [str(g) for g in gpus])
    theirs.set_ylim(0, 1.1)
    theirs.set_xlabel("GPUs")
    theirs.set_ylabel("tokens/s per GPU, relative to 8 GPUs")
    theirs.set_title("Published, strong scaling (the global batch fixed): " + PLAYBOOK_CONDITIONS.split(": ", 1)[1],
                     fontsize=8, loc="left", wrap=True)
    fig.tight_layout()
    return fig


def plot_input_stalls(per_loader: dict[str, dict]):
    """For each loader set-up, a step's time split into waiting for the batch and the rest (forward, backward
    with DDP's all-reduces, optimizer step), in ms: the median over the measured steps of rank 0."""
    names = list(per_loader)
    waits = [per_loader[n]["wait_ms"] for n in names]
    rest = [per_loader[n]["compute_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.6 * len(names)))
    ax.barh(names, waits, color=series_color(3), label="waiting for the next batch")
    ax.barh(names, rest, left=waits, color=series_color(1), label="forward, backward (with all-reduces), step")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (rank 0, median)")
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    fig.tight_layout()
    return fig


def plot_trace(spans, step_ms: float, title: str = "One DDP step in torch's profiler (rank 0)"):
    """The profiled step's spans (`lesson6_trace.profiled_step`) as a timeline, one row per thread."""
    threads = sorted({span.thread for span in spans}, key=lambda t: (t != "training loop", t))
    kinds = {"forward": 0, "backward": 1, "optimizer step": 2}
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.5 * len(threads)))
    shown = set()
    for span in spans:
        label = span.kind if span.kind in kinds else "all-reduce" if "reduce" in span.kind.lower() else span.kind
        color = series_color(kinds.get(label, 3))
        ax.barh(threads.index(span.thread), span.duration_ms, left=span.start_ms, height=0.6, color=color,
                edgecolor="white", linewidth=0.3, label=None if label in shown else label)
        shown.add(label)
    ax.set_yticks(range(len(threads)), threads)
    ax.invert_yaxis()
    ax.set_xlim(0, step_ms)
    ax.set_xlabel("milliseconds from the step's start")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def plot_link_timeline(ways: dict[str, dict], title: str = "One backward on rank 0 (its last repetition): the link's buckets"):
    """Per way of sending (a row each, {"computed", "total", "on_the_link": [(from, to), ...]} in seconds from the
    backward's start): the backward's computation as a shaded span, each bucket's time on the simulated link as a
    bar, and a tick where the averaged gradients were ready."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.8 * len(ways)))
    for row, (name, way) in enumerate(ways.items()):
        ax.barh(row, way["computed"] * 1e3, height=0.7, color=series_color(3), alpha=0.25,
                label="the backward computing" if row == 0 else None)
        for index, (start, end) in enumerate(way["on_the_link"]):
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.35, color=series_color(2),
                    edgecolor="white", label="a bucket on the link" if row == 0 and index == 0 else None)
        ax.plot([way["total"] * 1e3] * 2, [row - 0.4, row + 0.4], color="black", linewidth=2,
                label="the averaged gradients ready" if row == 0 else None)
    ax.set_yticks(range(len(ways)), list(ways))
    ax.set_ylim(len(ways) - 0.5, -0.9)
    ax.set_xlabel("ms from the start of the backward")
    ax.legend(fontsize=7, frameon=False, loc="upper right", ncols=3)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return fig
