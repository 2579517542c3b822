"""scripts/launch_lesson.sh: bad lesson numbers get the list of lessons; a lesson runs from its notebook
with per-rank output, its checks and its plots saved as PNG; a failing check makes it exit non-zero.

The course's own notebooks each run once in the suite already, in the browser test (which also
asserts each lesson's key check and its exercise's hint): here launch_lesson.sh runs a small
lesson of the same shape (a %%torchrun cell, a check on its facts, a plot), from a folder of lessons
given by DDP_LESSONS_NOTEBOOKS, as an instructor's copy of the course would be."""

import os
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent


def launch_lesson(argument: str, notebooks: Path | None = None, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"DDP_LESSONS_NOTEBOOKS": str(notebooks)} if notebooks else {})}
    return subprocess.run(["bash", str(ROOT / "scripts" / "launch_lesson.sh"), argument, *options],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("argument", ["9", "abc", ""])
def test_an_unknown_lesson_lists_the_lessons_available(argument):
    done = launch_lesson(argument)
    assert done.returncode != 0
    assert f"No lesson {argument!r}" in done.stderr
    assert re.search(r"^ +0 +check setup$", done.stderr, re.M) and re.search(r"^ +2b +ddp in practice$", done.stderr, re.M), done.stderr


SMALL_LESSON = [
    "%load_ext ddp_helpers",
    "%%torchrun -n 2 --name who --out who\n"
    "import torch, torch.distributed as dist\n"
    "from ddp_helpers import record\n"
    "dist.init_process_group('gloo')\n"
    "total = torch.tensor([float(dist.get_rank())])\n"
    "dist.all_reduce(total)\n"
    "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():.0f}')\n"
    "record('sum', total.item())\n"
    "dist.destroy_process_group()",
    "from ddp_helpers.course.checks import check\n"
    "check(who.facts('sum') == [1.0, 1.0], 'every rank holds the sum of the ranks', f'sums {who.facts(\"sum\")}')",
    "import matplotlib.pyplot as plt\n"
    "plt.bar([0, 1], [1, 1])\n"
    "plt.title('ranks')\n"
    "plt.show()",
]


def write_lessons(folder: Path, cells: list[str], name: str = "07_small_lesson.ipynb") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(source) for source in cells]), folder / name)
    return folder


def test_a_lesson_runs_from_its_notebook_with_per_rank_output_checks_and_plots(tmp_path):
    done = launch_lesson("7", write_lessons(tmp_path / "course", SMALL_LESSON))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[rank 1] rank 1 of 2: sum 1" in done.stdout  # each rank's output, prefixed
    assert "\u2713 every rank holds the sum of the ranks" in done.stdout
    assert "All 4 code cells of 07_small_lesson.ipynb ran" in done.stdout
    plots = sorted((tmp_path / "runs").glob("*/plots/*.png"))
    assert len(plots) == 1 and plots[0].stat().st_size > 5_000, plots


def test_a_failing_check_makes_the_lesson_exit_non_zero(tmp_path):
    course = write_lessons(tmp_path / "course", [
        "from ddp_helpers.course.checks import check\nprint('first cell ran')",
        "check(1 + 1 == 3, 'arithmetic holds', 'the sum was not 3')",
        "print('must not run')",
    ], name="07_broken.ipynb")
    done = launch_lesson("7", course)
    assert done.returncode == 1
    assert "first cell ran" in done.stdout
    assert "the sum was not 3" in done.stdout + done.stderr
    assert "must not run" not in done.stdout
    assert "code cell 2 of 07_broken.ipynb failed" in done.stderr


def test_the_terminal_shows_headings_expected_failures_whole_tables_and_closes_with_a_summary(tmp_path):
    """A lesson's shape in the terminal: each section's heading before its cells' output (a `#` comment in a code
    block is no heading), a table a cell displays as its text, a run the lesson fails on purpose shown whole (its
    traceback: often the lesson's subject) and marked with its own sign, not ✗, and a closing summary that calls
    the exercise as given wrong as expected, not a failure of the course."""
    cells = [
        new_code_cell("%load_ext ddp_helpers\nfrom ddp_helpers.course.checks import check"),
        new_markdown_cell("## 1. A rank that raises\n\nText the terminal does not show.\n\n```bash\n"
                          "# a comment in a code block\ntorchrun train.py\n```"),
        new_code_cell("%%torchrun -n 2 --name raises --out raises --may-fail\n"
                      "import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n"
                      "    raise ValueError('corrupt sample')\n"
                      "dist.barrier()\n"),
        new_code_cell("check(raises.first_failure.rank == 1, 'rank 1 is the root cause', 'another rank')\n"
                      "from IPython.display import Markdown, display\n"
                      "display(Markdown('| layout | fits |\\n|---|---|\\n| DDP | yes |'))"),
        new_markdown_cell("## Exercise: fix it"),
        new_code_cell("from ddp_helpers.course.exercises import ExerciseReport\n"
                      "ExerciseReport(mistakes=['one thing is wrong', 'another'])"),
    ]
    course = tmp_path / "course"
    course.mkdir()
    nbformat.write(new_notebook(cells=cells), course / "07_shape.ipynb")
    done = launch_lesson("7", course)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert out.index("## 1. A rank that raises") < out.index("code cell 2 of 4") < out.index("## Exercise: fix it")
    assert "Text the terminal does not show" not in out and "# a comment in a code block" not in out
    assert "| DDP | yes |" in out and "IPython.core.display.Markdown object" not in out
    assert "\u2298 expected: `raises` failed, as the lesson means it to: Rank 1 failed first" in out
    assert "corrupt sample" in out + done.stderr and "Traceback" in out + done.stderr  # shown whole, as in JupyterLab
    assert "\u2717 expected" not in out
    summary = out[out.index("=== Summary of 07_shape.ipynb ==="):]
    assert "\u2713 1 check held on your run." in summary
    assert "\u2298 1 failure the lesson runs on purpose, shown above in full and marked \u2298." in summary
    assert ("The exercise (code cell 4) as given: judged wrong, as expected (2 mistakes to find). Now solve it in "
            "JupyterLab") in summary
    assert "Plots: none in this lesson." in summary


def test_an_edited_lesson_runs_as_shipped_unless_asked_and_comes_back_with_the_edit_kept(tmp_path):
    """A learner's saved exercise attempt (here a cell that hangs... or simply prints) must not change what
    launch_lesson.sh runs: the lesson as git's last commit holds it runs, --mine runs the copy, and --restore puts
    the shipped notebook back, keeping the learner's copy beside it."""
    course = tmp_path / "clone" / "notebooks"
    write_lessons(course, ["print('as shipped')"])
    git = ["git", "-C", str(course.parent), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "course"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    notebook = course / "07_small_lesson.ipynb"
    write_lessons(course, ["print('my attempt')"])  # the learner's edit, saved in place

    shipped = launch_lesson("7", course)
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
    assert "as shipped" in shipped.stdout and "my attempt" not in shipped.stdout
    assert "--mine" in shipped.stdout and "--restore" in shipped.stdout  # it says what ran, and how to get the rest
    mine = launch_lesson("7", course, "--mine")
    assert "my attempt" in mine.stdout and "print('as shipped')" not in mine.stdout, mine.stdout + mine.stderr

    restored = launch_lesson("7", course, "--restore")
    assert restored.returncode == 0, restored.stdout + restored.stderr
    kept = list((course / "my_copies").glob("07_small_lesson.*.ipynb"))
    assert len(kept) == 1 and "my attempt" in kept[0].read_text()
    assert "as shipped" in notebook.read_text() and "my attempt" not in notebook.read_text()
    assert launch_lesson("7", course).stdout.count("has your edits") == 0  # nothing to tell once restored
