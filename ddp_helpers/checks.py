"""Lesson checks: each prints what it confirmed, or stops the notebook saying what went wrong."""

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
    if not condition:
        raise LessonCheckFailed(went_wrong)
    print("\u2713 " + wrapped(confirmed, 2))
