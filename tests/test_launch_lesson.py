"""scripts/launch_lesson.sh: bad lesson numbers get the list of lessons; every lesson with launches runs
through it (it also runs in CI under nbmake), and a failing check makes it exit non-zero."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argument", ["9", "abc", ""])
def test_an_unknown_lesson_lists_the_lessons_available(argument):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch_lesson.sh"), argument],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode != 0
    assert f"No lesson {argument!r}" in done.stderr
    assert "0  check setup" in done.stderr


def launch_lesson(number: int) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch_lesson.sh"), str(number)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# Per lesson: a check its run must confirm, the exercise as given judged, and how many plots it saves.
LESSONS = {
    1: ("\u2713 the averaged gradient is one process's gradient on the whole batch",
        "never finished: rank 0 in recv", "01_data_vs_model_parallelism", 3),
    3: ("\u2713 outputs, gradients and running statistics equal one process's BatchNorm",
        "holds sharded tensors (DTensors)", "03_syncbn_and_sharded_state", 3),
    4: ("\u2713 the final parameters are bitwise those of the run without a kill, on every rank",
        "ran twice: before the kill and again after the restart", "04_launching_with_torchrun", 3),
}


@pytest.mark.parametrize("number", sorted(LESSONS))
def test_a_lesson_runs_from_its_notebook_judges_its_exercise_and_saves_its_plots(tmp_path, number):
    confirmed, judged, notebook, plot_count = LESSONS[number]
    done = launch_lesson(number)
    assert confirmed in done.stdout
    assert judged in done.stdout
    plots = sorted((tmp_path / "runs" / notebook / "plots").glob("*.png"))
    assert len(plots) >= plot_count, plots


def test_lesson_2_runs_from_its_notebook_and_saves_its_plots(tmp_path):
    done = launch_lesson(2)
    from ddp_helpers.config import detect_hardware

    gpus = detect_hardware().gpu_count
    world = gpus if gpus >= 2 else 2  # one rank per GPU, or 2 CPU ranks
    last = world - 1
    assert f"[rank {last}] rank {last} of {world}, local rank {last}" in done.stdout  # per-rank results, prefixed
    assert "\u2713 after backward() every rank holds bitwise-identical gradients" in done.stdout
    plots = sorted((tmp_path / "runs" / "02_ddp_basics" / "plots").glob("*.png"))
    assert len(plots) >= 6, plots
    assert all(p.stat().st_size > 10_000 for p in plots)


def test_a_failing_check_makes_the_lesson_exit_non_zero(tmp_path):
    import sys

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    notebook = tmp_path / "07_broken.ipynb"
    nbformat.write(
        new_notebook(cells=[
            new_code_cell("from ddp_helpers.checks import check\nprint('first cell ran')"),
            new_code_cell("check(1 + 1 == 3, 'arithmetic holds', 'the sum was not 3')"),
            new_code_cell("print('must not run')"),
        ]),
        notebook,
    )
    # In a process of its own: the runner's IPython shell is a per-process singleton.
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from ddp_helpers.lesson_runner import run_notebook; "
         f"sys.exit(run_notebook(Path({str(notebook)!r})))"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "first cell ran" in done.stdout
    assert "the sum was not 3" in done.stdout + done.stderr
    assert "must not run" not in done.stdout
    assert "code cell 2 of 07_broken.ipynb failed" in done.stderr
