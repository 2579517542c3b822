"""The plots of lesson 3 (sharded state), drawn from what the ranks recorded; each returns the matplotlib
Figure. Ranks keep their `[rank r]` colours (`output.RANK_COLORS`); the course's shared plots are in `ddp_helpers.course.plots`."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ...plots import series_color


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
