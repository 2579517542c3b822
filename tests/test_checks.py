"""The two marks of a lesson's evidence: ✓ for a check the learner's script could fail, • for what torch
itself did in the run, which still stops the lesson when this torch behaves otherwise."""

import pytest

from ddp_helpers.course.checks import LessonCheckFailed, check, observed


def test_a_check_prints_a_tick_or_stops_with_what_went_wrong(capsys):
    check(True, "the ranks agree", "they differ")
    assert capsys.readouterr().out == "\u2713 the ranks agree\n"
    with pytest.raises(LessonCheckFailed, match="^they differ$"):
        check(False, "the ranks agree", "they differ")


def test_an_observation_prints_a_bullet_and_stops_when_torch_behaves_otherwise(capsys):
    observed(True, "the second job failed: EADDRINUSE", "it started")
    assert capsys.readouterr().out == "\u2022 the second job failed: EADDRINUSE\n"
    with pytest.raises(LessonCheckFailed, match="^this torch did not behave as the lesson says: it started$"):
        observed(False, "the second job failed: EADDRINUSE", "it started")
