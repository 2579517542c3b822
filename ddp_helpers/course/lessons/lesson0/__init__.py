"""Lesson 0 (check your set-up): the first exercise's checker.

The exercise: each rank holds a number only it knows, `my_number()`, and every rank must end holding the mean
of all the ranks' numbers. The number comes from the rank's secret (`ddp_helpers.rank_secret`: drawn at
random for each launch, handed to that rank's process alone), so no rank can compute another's: the ranks
must bring their numbers together, and any collective that does (all_reduce, all_gather, reduce + broadcast,
all_gather_object) is a right answer. The checker reads every rank's secret from the run folder and computes
the mean itself; it then runs the learner's cell again at another world size, where a divisor written for
the first one is wrong. Files written by the ranks, and bytes through the job's key-value store, are named: a
side channel is not a collective. And a right mean is not enough: each rank's own number must be seen going into
a collective (`records.RankRecords.handed_to_collectives`), whatever other road the numbers could take.
"""

from __future__ import annotations

from ...exercises import ExerciseReport, opening, run_again, side_channels
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

# The other world size the cell is run at, after the one the learner chose.
SECOND_WORLD_TIMEOUT_S = 60.0


def number_of(secret: int) -> float:
    """The exercise's number for a rank's secret: a whole number from 1 to 99."""
    return float(1 + secret % 99)


def my_number() -> float:
    """The number only this rank knows in the exercise (from its secret, drawn anew for each run)."""
    return number_of(rank_secret())


@records_progress  # the learner's progress notes whether this run passed
def check_mean_exercise(run: RunResult, *, second_world: bool = True) -> ExerciseReport:
    """Name what is wrong with the learner's run of the exercise, or confirm it."""
    report = ExerciseReport(verdict_when_passed="All checks pass: every rank holds the mean of all the ranks' "
                                                "numbers, at two world sizes.")
    world = len(run.ranks)
    if not _judge(run, report):
        return report
    if second_world:
        other = 3 if world == 2 else 2
        # On CPU ranks (a machine may have fewer GPUs than that): the cell asks for gloo anyway.
        again = run_again(run, other, SECOND_WORLD_TIMEOUT_S)
        if not again.ok:
            report.mistakes.append(f"run again by the checker on {other} ranks, the cell failed: {again.summary()[:300]}")
            return report
        _judge(again, report)
    return report


def _judge(run: RunResult, report: ExerciseReport) -> bool:
    """Add one verdict for `run` to `report`: the first mistake the ranks' means show, or the confirmation.
    Returns whether the run passed."""
    world = len(run.ranks)
    # Side channels are judged once the means are: a wrong mean is the first mistake to name.
    secrets = opening(run, report, ranks_for="one rank has nothing to combine", facts=("mean",), channels=False)
    if secrets is None:
        return False
    means = run.facts("mean")
    numbers = [number_of(secret) for secret in secrets]
    total = sum(numbers)
    expected = total / world
    held = [_as_number(mean) for mean in means]
    wrong = [rank for rank, value in enumerate(held) if not _close(value, expected)]
    if wrong:
        report.mistakes.append(f"on {world} ranks (numbers {', '.join(f'{n:g}' for n in numbers)}; mean {expected:g}), "
                               + _what_they_hold(wrong, held, numbers, total, world))
        return False
    around = side_channels(run)
    if around:
        report.mistakes.append(around)
        return False
    unseen = [rank for rank, number in enumerate(numbers) if not _went_into_a_collective(records(run)[rank], number, world)]
    if unseen:
        ranks = ", ".join(f"rank {rank}'s number {numbers[rank]:g}" for rank in unseen)
        report.mistakes.append(
            f"on {world} ranks, every rank holds the mean, but {ranks} went into no collective the launcher saw: the "
            "numbers reached the other ranks by some other way. What is that way, and what does this exercise ask "
            "the ranks to use?")
        return False
    report.confirmed.append(f"on {world} ranks, every rank holds the mean of the ranks' numbers "
                            f"({', '.join(f'{n:g}' for n in numbers)}): {expected:g}")
    return True


def _went_into_a_collective(rank, number: float, world: int) -> bool:
    """Positive evidence: the rank put its own number (or its share, number / world) into a collective that moves
    data (an all-reduce, all-gather, reduce, gather, ... as `records.RankRecords.handed_to_collectives` logs them). Learning
    the others' numbers by any other road (a socket, shared memory, another process's memory) shows none."""
    return any(_close(value, wanted) for call in rank.handed_to_collectives for value in call.get("values", ())
               for wanted in (number, number / world))


def _what_they_hold(wrong: list[int], held: list, numbers: list[float], total: float, world: int) -> str:
    """The first mistake the wrong ranks' values show, named, not its fix."""
    ranks = f"rank {wrong[0]}" if len(wrong) == 1 else f"ranks {', '.join(map(str, wrong))}"
    hold = "holds" if len(wrong) == 1 else "hold"
    values = [held[rank] for rank in wrong]
    if any(value is None for value in values):
        return f"{ranks} recorded no number as 'mean'"
    if all(_close(held[rank], numbers[rank]) for rank in wrong):
        own = "its" if len(wrong) == 1 else "their"
        return (f"{ranks} still {hold} only {own} own number. Each rank knows only its own number: how can every "
                "rank learn the others'?")
    if all(_close(value, total) for value in values):
        return f"{ranks} {hold} {total:g}, the sum of the ranks' numbers, not their mean"
    divisors = {round(total / value) for value in values if value}
    if len(divisors) == 1 and all(_close(value, total / next(iter(divisors))) for value in values):
        divisor = next(iter(divisors))
        if divisor != world:
            return (f"{ranks} {hold} the sum divided by {divisor}, at a world of {world} ranks: something in the cell "
                    "assumes a world size")
    return f"{ranks} {hold} {', '.join(f'{value:g}' for value in values)}, not the mean"


def _close(value: float | None, wanted: float) -> bool:
    return value is not None and abs(value - wanted) <= 1e-6 * max(1.0, abs(wanted))


def _as_number(value) -> float | None:
    try:
        return float(value)  # a float, a one-element tensor or array
    except (TypeError, ValueError, RuntimeError):
        return None
