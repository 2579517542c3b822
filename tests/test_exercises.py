"""Lesson 2's exercise: the checker names each mistake of the script as given, and passes the
solution shown (hidden) in the notebook. Both scripts are taken from the notebook itself."""

import re
from pathlib import Path

import nbformat
import pytest

from ddp_helpers.exercises import check_training_exercise
from support import failure_report, run_on_cpu

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "02_ddp_basics.ipynb"


def exercise_sources() -> tuple[str, str]:
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    broken = next(c.source for c in cells if c.source.startswith("%%torchrun --name exercise"))
    solution_cell = next(c.source for c in cells if c.cell_type == "markdown" and "Show the solution" in c.source)
    solution = re.search(r"```python\n(.*?)```", solution_cell, flags=re.S).group(1)
    assert "<details>" in solution_cell, "the solution must be hidden by default"
    strip_magic = lambda source: source.split("\n", 1)[1]  # noqa: E731
    return strip_magic(broken), strip_magic(solution)


@pytest.fixture(scope="module")
def sources():
    return exercise_sources()


def test_the_given_script_has_its_three_mistakes_named(write_script, sources):
    run = run_on_cpu(write_script("exercise", sources[0]), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert not report.passed
    text = str(report)
    assert "call sampler.set_epoch(epoch)" in text
    assert "rank(s) [0, 1] wrote the checkpoint: save on rank 0 only" in text
    assert "save model.module.state_dict()" in text
    assert "3 mistake(s) to fix" in text


def test_the_solution_passes(write_script, sources):
    run = run_on_cpu(write_script("exercise", sources[1]), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert report.passed, str(report)
    assert "All checks pass" in str(report)


def test_a_run_that_crashed_is_reported_as_such(write_script):
    run = run_on_cpu(write_script("crash", "raise RuntimeError('oops')\n"), nproc=2, stream=False)
    report = check_training_exercise(run)
    assert report.mistakes == ["the run did not finish; fix the error shown above first"]
