"""Lesson 4's exercise: run as the notebook runs it (rank 1 killed after step 5, one restart), the
checker names both mistakes of the script as given, passes the solution shown (hidden) in the notebook,
and refuses wrong fixes for what the ranks did (the steps each attempt printed, the final snapshot
against a run without a kill), not for what the script says."""

import re
from pathlib import Path

import nbformat
import pytest

from ddp_helpers.lessons.lesson4 import check_resume_exercise
from support import failure_report, run_on_cpu

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "04_launching_with_torchrun.ipynb"


def exercise_sources() -> tuple[str, str]:
    """(the exercise as given, the exercise with the solution's two changes)."""
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    cell = next(c.source for c in cells if c.source.startswith("%%torchrun --name exercise"))
    assert "--kill-rank 1 --kill-after 'step 5 done'" in cell.splitlines()[0]
    given = cell.split("\n", 1)[1] + "\n"
    solution_cell = next(c.source for c in cells if c.cell_type == "markdown" and "Show the solution" in c.source)
    assert "<details>" in solution_cell, "the solution must be hidden by default"
    resume, snapshot = re.findall(r"```python\n(.*?)```", solution_cell, flags=re.S)
    given_snapshot = re.search(r"        if rank == 0:\n            torch.save\(.*?os.replace\(.*?\)\n", given, flags=re.S).group(0)
    solution = given.replace('    first_step = snapshot["step"]\n', resume).replace(given_snapshot, snapshot)
    assert solution != given
    return given, solution


GIVEN, SOLUTION = exercise_sources()
WRONG_FIXES = {
    "the step only": (GIVEN.replace('first_step = snapshot["step"]', 'first_step = snapshot["step"] + 1'),
                      "ended with other weights than without a kill"),
    "the random state only": (SOLUTION.replace('first_step = snapshot["step"] + 1', 'first_step = snapshot["step"]'),
                              "step(s) [5] ran twice"),
    "rank 0's random state on every rank": (SOLUTION.replace('snapshot["random"][rank]', 'snapshot["random"][0]'),
                                            "ended with other weights than without a kill"),
    "no resume at all": (GIVEN.replace('if os.path.exists("snapshot.pt"):', "if False:"),
                         "step(s) [0, 1, 2, 3, 4, 5] ran twice"),
    "the progress line removed": (SOLUTION.replace('print(f"step {step} done")', "pass"), "no rank was killed"),
}


def run_as_the_notebook_does(write_script, source):
    return run_on_cpu(write_script("exercise", source), nproc=2, stream=False, max_restarts=1, kill_rank=1,
                      kill_after="step 5 done", timeout_s=60)


def test_the_given_script_has_both_mistakes_named_without_the_fix(write_script):
    run = run_as_the_notebook_does(write_script, GIVEN)
    assert run.ok and run.restarts == 1, failure_report(run)
    text = str(check_resume_exercise(run))
    assert "step(s) [5] ran twice" in text and "ended with other weights than without a kill" in text, text
    assert "2 mistake(s) to fix" in text
    assert "rng" not in text.lower() and "+ 1" not in text, "hints must not give the fix"


def test_the_solution_passes(write_script):
    run = run_as_the_notebook_does(write_script, SOLUTION)
    assert run.ok, failure_report(run)
    report = check_resume_exercise(run)
    assert report.passed, str(report)
    assert "every one of the 24 steps ran exactly once" in str(report)


@pytest.mark.parametrize("wrong_fix", list(WRONG_FIXES))
def test_a_wrong_fix_does_not_pass(write_script, wrong_fix):
    source, named = WRONG_FIXES[wrong_fix]
    assert source not in (GIVEN, SOLUTION), "the wrong fix must change the script"
    run = run_as_the_notebook_does(write_script, source)
    report = check_resume_exercise(run)
    assert not report.passed, failure_report(run)
    assert named in str(report), str(report) + "\n" + failure_report(run)
