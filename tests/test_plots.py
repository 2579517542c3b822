"""The plots are readable at a glance: titles, axis labels, legends, and each rank in its output colour."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.colors import to_hex  # noqa: E402

from ddp_helpers.course import plots  # noqa: E402
from ddp_helpers.course.lessons.lesson2 import plots as lesson2_plots; from ddp_helpers.course.lessons.lesson3 import plots as lesson3_plots; from ddp_helpers.course.lessons.lesson4 import plots as lesson4_plots  # noqa: E402
from ddp_helpers.output import RANK_COLORS, rank_prefix  # noqa: E402


def test_partition_plot_colours_each_cell_by_its_rank():
    fig = lesson2_plots.plot_partitions([[[0, 2], [1, 3]], [[3, 1], [0, 2]]], 4, ["epoch 0", "epoch 1"])
    first = fig.axes[0]
    assert first.get_title() == "epoch 0"
    assert fig.get_suptitle() == "Which samples each rank sees"
    colours = {to_hex(p.get_facecolor()) for p in first.patches}
    assert colours == {RANK_COLORS[0], RANK_COLORS[1]}
    assert [t.get_text() for t in first.get_yticklabels()] == ["rank 0", "rank 1"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["rank 0", "rank 1"]


def test_partition_plot_marks_repeated_indices():
    fig = lesson2_plots.plot_partitions([[[0, 1], [1, 2]]], 3, ["padded"])
    assert "\u00d72" in [t.get_text() for t in fig.axes[0].texts]


def test_gradient_agreement_plot_marks_exact_zeros_and_the_tolerance():
    fig = lesson2_plots.plot_gradient_agreement(["w", "b"], {"across ranks": [0.0, 0.0], "vs reference": [1e-8, 0.0]}, tolerance=1e-5)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel().startswith("largest |difference|")
    assert [t.get_text() for t in ax.texts].count("0") == 3
    assert "tolerance 1e-05" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_loss_and_weight_plots_use_rank_colours():
    fig = plots.plot_loss_per_rank([[1.0, 0.5], [0.9, 0.4], [1.1, 0.3]])
    assert [to_hex(line.get_color()) for line in fig.axes[0].lines] == list(RANK_COLORS[:3])
    fig = lesson2_plots.plot_weights_per_rank({"before": [[1, 2], [3, 4]]}, title="weights")
    assert {to_hex(p.get_facecolor()) for p in fig.axes[0].patches} == {RANK_COLORS[0], RANK_COLORS[1]}


def test_output_prefix_uses_the_same_colour_as_the_plots():
    red, green, blue = (int(RANK_COLORS[1][i : i + 2], 16) for i in (1, 3, 5))
    assert f"38;2;{red};{green};{blue}m[rank 1]" in rank_prefix(1)
    assert rank_prefix(1, color=False) == "[rank 1]"


def test_series_that_are_not_ranks_use_colours_no_rank_uses_and_bars_leave_room():
    fig = lesson3_plots.plot_memory_and_communication([1, 2], {"DDP": [4.0, 4.0], "FSDP": [4.0, 2.0]},
                                              {"DDP": {"all_reduce": 2**20}, "FSDP": {"all_gather": 2**21}})
    memory, traffic = fig.axes
    used = {to_hex(p.get_facecolor()) for ax in (memory, traffic) for p in ax.patches}
    assert used and not used & set(RANK_COLORS), used
    assert traffic.get_ylim()[1] > 2.0 * 1.2 and memory.get_ylim()[1] > 4.0 * 1.2
    fig = lesson4_plots.plot_steps_by_attempt([{"step": 0, "loss": 1.0, "attempt": 1}, {"step": 1, "loss": 0.5, "attempt": 2}])
    assert not {to_hex(line.get_color()) for line in fig.axes[0].lines} & set(RANK_COLORS)
    fig = plots.plot_bars(["a", "b"], [10.0, 65536.0], "bytes", "bytes")
    assert fig.axes[0].get_ylim()[1] >= 65536.0 * 3, "the tallest bar's label needs room"
