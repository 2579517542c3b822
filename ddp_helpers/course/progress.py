"""A learner's progress through the course, and an instructor's table of it across learners.

Each lesson check (`checks.check`) and each exercise checker a learner runs appends one line to `progress.jsonl`
in the learner's runs folder (`run_folder.runs_root()`: private to them, 0700): which lesson, which check (its
ledger line, `lessons/<lesson>/checks.md`) or the exercise, passed or not, when. `show_progress()` prints the
learner's table: per lesson, how many of its checks passed in their own runs, and whether its exercise did.

An instructor runs `python -m ddp_helpers.course.progress alice bob ...` with rights that can read the learners'
files (root, on a workshop's server): it reads each learner's file from the runs folder their course uses on a
shared install, `~learner/.cache/ddp-helpers/runs/progress.jsonl`, and prints one row per learner. Learners
cannot read each other's: the file lives in their private runs folder. The instructor's read trusts nothing there:
a file that is not a regular file owned by that learner (a link planted to make root read something else) is
skipped, as is any line that is not a well-formed record of a known lesson.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
import time
from pathlib import Path

PROGRESS_FILE = "progress.jsonl"
MAX_BYTES = 4 << 20  # an instructor reads at most this much of a learner's file
_EXERCISE = "exercise"


@functools.cache
def _ledgers() -> dict[str, list[tuple[re.Pattern, str]]]:
    """{lesson key: [(pattern, start)]}: each ✓ of a lesson as its ledger quotes it (its message's first 60
    characters, an f-string's fields as "…"), as a pattern that matches the message the check prints."""
    from .manifest import lessons

    line = re.compile(r'^- `[^`]+` "(.+?)" — ', re.M)
    found = {}
    for lesson in lessons().values():
        text = lesson.ledger.read_text() if lesson.ledger.is_file() else ""
        found[lesson.key] = [(re.compile(".*?".join(map(re.escape, start.split("…"))), re.S), start)
                             for start in line.findall(text)]
    return found


def lesson_of_check(message: str) -> tuple[str, str] | None:
    """(lesson key, the ledger's quote) of the ✓ whose message this is, or None (a check of the learner's own)."""
    for key, checks in _ledgers().items():
        for pattern, start in checks:
            if pattern.match(message):
                return key, start
    return None


def lesson_of_module(module: str) -> str | None:
    """The lesson key of a module of the course's lessons ("ddp_helpers.course.lessons.lesson2b..." -> "2b")."""
    found = re.search(r"\.lessons\.lesson(\d+[a-z]?)(\.|$)", module)
    return found.group(1) if found else None


def _note(entry: dict) -> None:
    """Append one record to the learner's progress file; never a reason for a lesson to fail."""
    try:
        from ..private_folders import private_folder
        from ..run_folder import runs_root

        folder = private_folder(runs_root())
        line = (json.dumps({**entry, "time": round(time.time())}) + "\n").encode()
        descriptor = os.open(folder / PROGRESS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(descriptor, line)  # one write of a short line with O_APPEND: two kernels never interleave
        finally:
            os.close(descriptor)
    except Exception:  # noqa: BLE001 - progress is a courtesy: a lesson's check or checker goes on regardless
        pass


def note_check(message: str, passed: bool) -> None:
    found = lesson_of_check(message)
    if found:
        _note({"lesson": found[0], "kind": "check", "name": found[1], "passed": passed})


def note_exercise(module: str, passed: bool) -> None:
    lesson = lesson_of_module(module)
    if lesson:
        _note({"lesson": lesson, "kind": _EXERCISE, "name": _EXERCISE, "passed": passed})


def records_progress(checker):
    """An exercise checker that also notes, in the learner's progress, whether the run it judged passed."""

    @functools.wraps(checker)
    def judged(*args, **kwargs):
        report = checker(*args, **kwargs)
        note_exercise(checker.__module__, bool(getattr(report, "passed", False)))
        lesson = lesson_of_module(checker.__module__)
        if lesson and hasattr(report, "progress"):
            report.progress = lesson_line(lesson)
        return report

    return judged


def summary(lines) -> dict[str, dict]:
    """{lesson key: {"checks": {quote: passed}, "exercise": True/False/None}} from progress lines (the latest of
    each check wins); lines that are not well-formed records of a known lesson and check are left out."""
    known = {key: {start for _, start in checks} for key, checks in _ledgers().items()}
    found: dict[str, dict] = {key: {"checks": {}, "exercise": None} for key in known}
    for line in lines:
        try:
            entry = json.loads(line)
        except (ValueError, TypeError):
            continue
        if not isinstance(entry, dict) or entry.get("lesson") not in known or not isinstance(entry.get("passed"), bool):
            continue
        lesson = found[entry["lesson"]]
        if entry.get("kind") == _EXERCISE:
            lesson["exercise"] = entry["passed"]
        elif entry.get("kind") == "check" and entry.get("name") in known[entry["lesson"]]:
            lesson["checks"][entry["name"]] = entry["passed"]
    return found


def _cell(lesson: dict, total: int) -> str:
    passed = sum(lesson["checks"].values())
    exercise = {True: "exercise ✓", False: "exercise not yet", None: ""}[lesson["exercise"]]
    checks = f"{passed}/{total} checks" if lesson["checks"] else ""
    return ", ".join(part for part in (checks, exercise) if part) or "·"


def _own_lines() -> list[str]:
    from ..run_folder import runs_root

    try:
        return (runs_root() / PROGRESS_FILE).read_text().splitlines()
    except OSError:
        return []


def lesson_line(key: str) -> str:
    """One line of the learner's progress in lesson `key`, said after its exercise's verdict."""
    found, total = summary(_own_lines()).get(key), _total(key)
    if found is None:
        return ""
    checks = f"{sum(found['checks'].values())} of its {total} checks passed in your runs; " if total else ""
    exercise = {True: "its exercise passed", False: "its exercise not yet", None: "its exercise not run"}[found["exercise"]]
    return f"Lesson {key} so far: {checks}{exercise} (show_progress() lists every lesson)."


def _total(key: str) -> int:
    """How many ✓ checks lesson `key` makes (its ledger's distinct quotes)."""
    return len({start for _, start in _ledgers().get(key, [])})


def learner_table(found: dict[str, dict]) -> str:
    from .manifest import lessons

    rows = [("lesson", "checks that passed in your runs", "exercise")]
    for key, lesson in lessons().items():
        progress, total = found.get(key, {"checks": {}, "exercise": None}), _total(key)
        checks = f"{sum(progress['checks'].values())} of {total}" if total else "-"
        exercise = ({True: "passed", False: "tried, not yet", None: "not run"}[progress["exercise"]]
                    if lesson.checker else "-")
        rows.append((f"{key}{' (deep dive)' if lesson.deep_dive else ''}", checks, exercise))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows)


def show_progress() -> None:
    """Print this learner's progress: per lesson, its checks that passed in their own runs, and its exercise."""
    from ..run_folder import runs_root

    print(f"Your progress (from {runs_root() / PROGRESS_FILE}):\n" + learner_table(summary(_own_lines())))


def read_learners_file(user: str) -> list[str] | None:
    """The lines of `user`'s progress file, read as the instructor (None: no such user, no file, or not a regular
    file of theirs). Opened without following links, and held to the learner as its owner."""
    import pwd

    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return None
    path = Path(account.pw_dir) / ".cache" / "ddp-helpers" / "runs" / PROGRESS_FILE
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != account.pw_uid:
            return None
        data = os.read(descriptor, MAX_BYTES)
    finally:
        os.close(descriptor)
    return data.decode("utf-8", errors="replace").splitlines()


def instructor_table(users: list[str]) -> str:
    from .manifest import lessons

    keys = [key for key, lesson in lessons().items() if not lesson.deep_dive]
    rows = [("learner", *[f"lesson {key}" for key in keys])]
    for user in users:
        lines = read_learners_file(user)
        if lines is None:
            rows.append((user, *(["no progress file"] + [""] * (len(keys) - 1))))
            continue
        found = summary(lines)
        rows.append((user, *[_cell(found[key], _total(key)) for key in keys]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in rows)


def main(argv=None) -> int:
    users = list(sys.argv[1:] if argv is None else argv)
    if not users:
        print("Usage: python -m ddp_helpers.course.progress LEARNER... (as a user who may read the learners' files, "
              "e.g. with sudo): each learner's checks that passed and exercises, per lesson of the core path.",
              file=sys.stderr)
        return 2
    print(instructor_table(users))
    return 0


if __name__ == "__main__":
    sys.exit(main())
