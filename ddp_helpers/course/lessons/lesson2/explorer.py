"""Lesson 2's partition explorer (ipywidgets): turn a slider instead of editing code.

`partition_explorer(run)` shows which samples each rank gets from `DistributedSampler`, for a
world size and epoch chosen with sliders, with or without `set_epoch`. The indices are recomputed
here with the very sampler the ranks use (a sampler needs no process group when it is told
`num_replicas` and `rank`). A button re-runs the lesson's step on the chosen number of ranks and
redraws from what the ranks recorded.

Without a live widget frontend (nbmake, nbconvert, `launch_lesson.sh`) the display falls back to a
static PNG of the initial plot, carried in the same output.
"""

from __future__ import annotations

import base64
import io

import matplotlib.pyplot as plt

from ....errors import LaunchError
from ....launch_options import make_launch_config
from ....launcher import launch
from ...widgets import display_with_fallback
from .plots import plot_partitions


def sampler_partition(dataset_size: int, world_size: int, epoch: int, call_set_epoch: bool, seed: int = 0):
    """Per rank, the indices `DistributedSampler` yields in `epoch` (as epoch 0 when set_epoch is not called)."""
    from torch.utils.data import DistributedSampler

    partition = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, seed=seed)
        if call_set_epoch:
            sampler.set_epoch(epoch)
        partition.append(list(sampler))
    return partition


def recorded_partition(run, epoch: int, call_set_epoch: bool):
    """Per rank, the indices recorded by lesson 2's step 7 cell for `epoch`."""
    return run.facts(f"{'with' if call_set_epoch else 'without'}_epoch{epoch}")


def _figure(dataset_size, epoch, call_set_epoch, first_epoch, chosen_epoch, source):
    label = "with set_epoch" if call_set_epoch else "without set_epoch"
    same = first_epoch == chosen_epoch
    return plot_partitions(
        [first_epoch, chosen_epoch],
        dataset_size,
        ["epoch 0", f"epoch {epoch}" + (" (same order as epoch 0)" if same and epoch else "")],
        suptitle=f"{len(first_epoch)} ranks, {label} ({source})",
    )


def _png_base64(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def partition_explorer(run=None, dataset_size: int = 12, epochs: int = 3, max_world_size: int = 8) -> None:
    """Display sliders for world size and epoch, a set_epoch toggle, and (given the step-7 run) a
    button that re-runs that step's script on the chosen number of ranks.

    Args:
        run (RunResult | None): lesson 2's step-7 run; its script is what the button re-runs.
        dataset_size (int): samples in the data set (12 in step 7).
        epochs (int): the epoch slider goes from 0 to epochs - 1.
        max_world_size (int): the world-size slider's maximum.
    """
    # Long on purpose: the callbacks are closures over the controls; split up, they would pass six widgets around.
    import ipywidgets as widgets
    from IPython import get_ipython
    from IPython.display import display

    world = widgets.IntSlider(value=2, min=1, max=max_world_size, description="world size")
    epoch = widgets.IntSlider(value=1, min=0, max=epochs - 1, description="epoch")
    set_epoch = widgets.Checkbox(value=False, description="call sampler.set_epoch(epoch)", indent=False)
    rerun = widgets.Button(description="Re-run step 7 on these ranks", button_style="primary",
                           layout={"width": "max-content"}, disabled=run is None)
    status = widgets.HTML()
    plot_area = widgets.Output()
    recorded = {"run": None}  # the latest re-run, whose recorded indices are drawn while its world size is chosen

    def current_figure():
        latest = recorded["run"]
        if latest is not None and len(latest.ranks) == world.value:
            first = recorded_partition(latest, 0, set_epoch.value)
            chosen = recorded_partition(latest, epoch.value, set_epoch.value)
            source = "recorded by the ranks"
        else:
            first = sampler_partition(dataset_size, world.value, 0, set_epoch.value)
            chosen = sampler_partition(dataset_size, world.value, epoch.value, set_epoch.value)
            source = "computed with DistributedSampler"
        return _figure(dataset_size, epoch.value, set_epoch.value, first, chosen, source)

    def redraw(*_):
        if getattr(get_ipython(), "kernel", None) is None:
            return  # no frontend to draw into (launch_lesson.sh): the static plot below stands in
        with plot_area:
            plot_area.clear_output(wait=True)
            fig = current_figure()
            display(fig)
            plt.close(fig)

    def rerun_step(_):
        rerun.disabled = True
        status.value = f"running step 7 on {world.value} rank(s) ..."
        try:
            # CPU ranks (gloo) whatever the machine: the partition does not depend on the backend, and a
            # GPU box may have fewer GPUs than the ranks asked for on the slider.
            latest = launch(make_launch_config(run.config.script, nproc=world.value, backend="gloo", stream=False,
                                               run_dir=run.config.run_dir.with_name(run.config.run_dir.name + "_explorer")))
        except LaunchError as error:
            status.value = f"<span style='color:#d62728'>{error}</span>"
        else:
            recorded["run"] = latest if latest.ok else None
            status.value = (f"ran on {len(latest.ranks)} ranks in {latest.wall_time_s:.1f} s: the plot now shows what they recorded"
                            if latest.ok else f"<span style='color:#d62728'>the run failed: {latest.summary().splitlines()[1]}</span>")
        finally:
            rerun.disabled = False
        redraw()

    for control in (world, epoch, set_epoch):
        control.observe(redraw, names="value")
    rerun.on_click(rerun_step)
    redraw()

    static = current_figure()
    display_with_fallback(
        widgets.VBox([widgets.HBox([world, epoch, set_epoch]), widgets.HBox([rerun, status]), plot_area]),
        {
            "image/png": _png_base64(static),
            "text/plain": "Sample-partition explorer (sliders need a live Jupyter kernel; static plot shown)",
        },
    )
    plt.close(static)
