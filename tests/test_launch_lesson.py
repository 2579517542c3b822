"""scripts/launch_lesson.sh: bad lesson numbers get the list of lessons; the lessons themselves run
in CI under nbmake, and lesson 2 through this script in its own test."""

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
