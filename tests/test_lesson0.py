"""Lesson 0's exercise (every rank learns the mean of numbers only each rank knows): the exercise as given
and the wrong fixes are judged wrong, with what is wrong named; the solution passes."""

import pytest

from ddp_helpers.lessons.lesson0 import check_mean_exercise
from support import exercise_cells, failure_report, run_on_cpu

GIVEN_MEAN = "mean = number  # every rank should end with the mean of all the ranks' numbers\n"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, *_) = exercise_cells("00_check_setup.ipynb", "%%torchrun --nproc 2 --backend gloo --name exercise")
    assert GIVEN_MEAN in given
    return given, solution.split("\n", 1)[1]  # the solution without its %%torchrun line


def judged(write_script, source: str, nproc: int = 2):
    run = run_on_cpu(write_script("exercise", source), nproc=nproc, stream=False)
    return run, check_mean_exercise(run)


def test_the_exercise_as_given_is_judged_wrong(write_script, sources):
    run, report = judged(write_script, sources[0])
    assert run.ok and not report.passed, failure_report(run)
    assert "not every rank holds the mean of the 2 ranks' numbers (2.5): rank 0 holds 1, rank 1 holds 4" in str(report)
    assert "rank(s) [0, 1] never handed their own number to a collective" in str(report)
    assert "all_reduce" not in str(report), "the hints name the mistake, not the fix"


def test_the_solution_passes_on_two_and_three_ranks(write_script, sources):
    for nproc, mean in ((2, "2.5"), (3, "4.66667")):
        run, report = judged(write_script, sources[1], nproc)
        assert run.ok and report.passed, f"{report}\n{failure_report(run)}"
        assert f"mean of the {nproc} ranks' numbers, {mean}" in str(report)


WRONG_FIXES = {
    # The formula every rank can compute alone: the right numbers, no communication.
    "the formula on every rank": (GIVEN_MEAN, "mean = torch.tensor([sum((r + 1) ** 2 for r in range(world_size)) / "
                                              "world_size])\n", "never handed their own number"),
    # An all-reduce for show, of something else, and the formula.
    "an all-reduce of ones beside the formula": (
        GIVEN_MEAN, "dist.all_reduce(torch.ones(1))\nmean = torch.tensor([sum((r + 1) ** 2 for r in range(world_size)) / "
                    "world_size])\n", "never handed their own number"),
    # The sum, not the mean.
    "the sum, not divided": (GIVEN_MEAN, "mean = number.clone()\ndist.all_reduce(mean)\n", "not every rank holds the mean"),
}


@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_a_wrong_fix_does_not_pass(write_script, sources, name):
    old, new, named = WRONG_FIXES[name]
    run, report = judged(write_script, sources[0].replace(old, new))
    assert run.ok and not report.passed and named in str(report), f"{report}\n{failure_report(run)}"


def test_one_rank_is_not_enough(write_script, sources):
    run, report = judged(write_script, sources[1], nproc=1)
    assert not report.passed and "run it on 2 ranks or more" in str(report), str(report)
