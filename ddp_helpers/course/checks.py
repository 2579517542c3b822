"""Lesson checks: each prints what it confirmed, or stops the notebook saying what went wrong.

`check` is for what the learner's script could get wrong: it prints `✓ ...`. `observed` is for what torch
itself did in the run (a guarantee, or arithmetic on shapes the cell chose): it prints `• ...`, no ✓,
and still stops the lesson if this torch behaved otherwise than the lesson says."""

from __future__ import annotations

from .notebook_text import wrapped


class LessonCheckFailed(AssertionError):
    """A lesson's claim did not hold on the learner's own run. Shown as its message alone."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31mCheck failed:\x1b[0m {wrapped(str(self), len('Check failed: '))}"]


def check(condition: bool, confirmed: str, went_wrong: str) -> None:
    """Print `✓ confirmed` if `condition` holds; otherwise raise LessonCheckFailed(went_wrong).

    Example:
        >>> check(len(set(ids)) == 1, "every rank sees the same weights", f"weights differ: {ids}")
    """
    from .progress import note_check

    note_check(confirmed, bool(condition))  # the learner's progress: this lesson's check, passed or not
    if not condition:
        raise LessonCheckFailed(went_wrong)
    print("\u2713 " + wrapped(confirmed, 2))


def observed(condition: bool, seen: str, otherwise: str) -> None:
    """Print `• seen`, what the run showed torch doing, if `condition` holds; otherwise raise
    LessonCheckFailed: this torch did not behave as the lesson says (`otherwise` shows what it did).

    Example:
        >>> observed(code != 0 and "EADDRINUSE" in output, "the second job failed: EADDRINUSE", output[-300:])
    """
    if not condition:
        raise LessonCheckFailed(f"this torch did not behave as the lesson says: {otherwise}")
    print("\u2022 " + wrapped(seen, 2))
