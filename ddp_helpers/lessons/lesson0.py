"""Lesson 0 (check your set-up): the first exercise's checker.

The exercise: each rank holds a number only it knows, (rank + 1) ** 2, and every rank must end holding
the mean of all the ranks' numbers. As given, each rank records its own number. The checker computes the
mean itself for the run's world size, and reads what each rank handed to `dist.all_reduce` (the
launcher's log, `RankResult.all_reduced`): each rank's own number (or it divided by the world size) must
be among them. So every rank computing the mean from the formula without communicating, or all-reducing
something else, does not pass.
"""

from __future__ import annotations

from ..exercises import ExerciseReport
from ..result import RunResult


def own_number(rank: int) -> float:
    """The number only `rank` knows in the exercise."""
    return float(rank + 1) ** 2


def check_mean_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's run of the exercise, or confirm it."""
    report = ExerciseReport(verdict_when_passed="All checks pass: every rank put in its own number, and every "
                                                "rank holds the mean of all of them.")
    if not run.ok:
        report.mistakes.append("the run did not finish; fix the error shown above first")
        return report
    world = len(run.ranks)
    if world < 2:
        report.mistakes.append(f"run it on 2 ranks or more (it ran on {world}): one rank has nothing to combine")
        return report
    try:
        means = run.facts("mean")
    except KeyError:
        report.mistakes.append("keep the record('mean', ...) line: the checker reads it")
        return report
    expected = sum(own_number(rank) for rank in range(world)) / world
    held = {rank: _as_number(mean) for rank, mean in enumerate(means)}
    wrong = {rank: value for rank, value in held.items() if value is None or abs(value - expected) > 1e-6 * expected}
    if wrong:
        report.mistakes.append(
            f"not every rank holds the mean of the {world} ranks' numbers ({expected:g}): "
            + ", ".join(f"rank {rank} holds {value if value is None else f'{value:g}'}" for rank, value in wrong.items())
            + ". Each rank knows only its own number: how can every rank learn the others'?")
    else:
        report.confirmed.append(f"every rank holds the mean of the {world} ranks' numbers, {expected:g}")
    silent = [r.rank for r in run.ranks if not _handed_in(r.all_reduced, own_number(r.rank), world)]
    if silent:
        report.mistakes.append(
            f"rank(s) {silent} never handed their own number to a collective (the launcher sees what each rank "
            "hands one): the mean must come from the ranks' own numbers, combined, not from a formula every rank "
            "computes alone")
    else:
        report.confirmed.append("each rank handed its own number to dist.all_reduce (seen by the launcher), which "
                                "gave every rank the sum")
    return report


def _as_number(value) -> float | None:
    try:
        return float(value)  # a float, a one-element tensor or array
    except (TypeError, ValueError, RuntimeError):
        return None


def _handed_in(all_reduced, number: float, world: int) -> bool:
    """Whether `number` (or it divided by the world size) is among the values a rank handed to all_reduce."""
    wanted = (number, number / world)
    return any(abs(value - w) <= 1e-6 * max(1.0, abs(w)) for call in all_reduced for value in call.get("values", ())
               for w in wanted)
