"""A learner's progress (ddp_helpers/course/progress.py): each lesson ✓ and exercise verdict is noted in the learner's
own runs folder, shown back to them, and tabled for an instructor who reads the learners' files with their own rights
(root here: the learners are real Unix users, made here and acting through `setpriv`), never by one learner of
another, and never following what a learner planted in place of their file."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK_OF_LESSON_1 = "the averaged gradient is one process's gradient on the whole batch"
LEARNERS = ("ddp-lessons-alice", "ddp-lessons-bob")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making learners as Unix users needs root")


def in_a_process(source: str, runs: Path, umask: int = 0o022) -> str:
    result = subprocess.run([sys.executable, "-c", f"import os; os.umask({umask})\n" + textwrap.dedent(source)],
                            env={**os.environ, "DDP_HELPERS_RUNS": str(runs)}, capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_lessons_checks_and_exercise_are_noted_privately_and_shown_back(tmp_path):
    runs = tmp_path / "runs"
    shown = in_a_process(f'''
        from ddp_helpers.course.checks import LessonCheckFailed, check
        from ddp_helpers.course.exercises import ExerciseReport
        from ddp_helpers.course.progress import records_progress, show_progress

        check(True, {CHECK_OF_LESSON_1!r}, "")
        check(True, "a check of the learner's own, in no lesson", "")
        try:
            check(False, "loss and gradients equal the unsplit model's (largest difference 1e-3)", "off")
        except LessonCheckFailed:
            pass

        def check_pipeline_exercise(run):
            return ExerciseReport(mistakes=[] if run else ["wrong"])
        check_pipeline_exercise.__module__ = "ddp_helpers.course.lessons.lesson1"
        judge = records_progress(check_pipeline_exercise)
        print(judge(False))
        print(judge(True))
        show_progress()
    ''', runs, umask=0)
    assert "Lesson 1 so far: 1 of its 12 checks passed in your runs; its exercise not yet" in shown, shown
    assert "Lesson 1 so far: 1 of its 12 checks passed in your runs; its exercise passed" in shown, shown
    table = shown[shown.index("Your progress"):]
    row = next(line for line in table.splitlines() if line.startswith("1 "))
    assert row.split()[1:] == ["1", "of", "12", "passed"], row
    progress = runs / "progress.jsonl"
    assert stat.S_IMODE(progress.stat().st_mode) == 0o600 and stat.S_IMODE(runs.stat().st_mode) == 0o700
    assert "own, in no lesson" not in progress.read_text()


def test_a_check_that_failed_after_passing_counts_as_failed(tmp_path):
    from ddp_helpers.course.progress import summary

    lines = ['{"lesson": "1", "kind": "check", "name": "the averaged gradient is one process\'s gradient on the whole", '
             f'"passed": {value}}}' for value in ("true", "false")]
    lines += ["not json", '{"lesson": "99", "kind": "exercise", "passed": true}', '{"lesson": "1", "kind": "exercise"}']
    found = summary(lines)
    assert found["1"]["checks"] == {"the averaged gradient is one process's gradient on the whole": False}
    assert found["1"]["exercise"] is None and "99" not in found


def learner(name: str, homes: Path) -> pwd.struct_passwd:
    home = homes / name
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--home-dir", str(home), "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        account = pwd.getpwnam(name)
    subprocess.run(["rm", "-rf", account.pw_dir], check=False)
    Path(account.pw_dir).mkdir(parents=True, mode=0o755)
    os.chown(account.pw_dir, account.pw_uid, account.pw_gid)
    return account


def as_learner(account: pwd.struct_passwd, source: str) -> subprocess.CompletedProcess:
    """`source` run as the learner, with the course's environment, their home and no DDP_HELPERS_RUNS: their runs go
    where a shared install sends them, their own cache."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": account.pw_dir,
           "PYTHONPATH": str(ROOT), "DDP_LESSONS_COURSE_UNDER_TEST": os.environ.get("DDP_LESSONS_COURSE_UNDER_TEST", "")}
    return subprocess.run(["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
                           sys.executable, "-c", textwrap.dedent(source)], env=env, cwd="/", capture_output=True,
                          text=True, timeout=120)


@needs_root
def test_the_instructor_sees_every_learner_and_no_learner_sees_another(tmp_path):
    homes = Path("/var/tmp/ddp-lessons-learners")
    homes.mkdir(mode=0o755, exist_ok=True)
    alice, bob = (learner(name, homes) for name in LEARNERS)
    # The course is the instructor's, read-only to the learners: their runs go to their own cache.
    solved = as_learner(alice, f'''
        from ddp_helpers.course.checks import check
        from ddp_helpers.course.exercises import ExerciseReport
        from ddp_helpers.course.progress import records_progress
        check(True, {CHECK_OF_LESSON_1!r}, "")
        def check_mean_exercise(run):
            return ExerciseReport()
        check_mean_exercise.__module__ = "ddp_helpers.course.lessons.lesson0"
        print(records_progress(check_mean_exercise)(None))
    ''')
    assert solved.returncode == 0, solved.stderr
    file = Path(alice.pw_dir) / ".cache" / "ddp-helpers" / "runs" / "progress.jsonl"
    assert file.is_file() and file.stat().st_uid == alice.pw_uid
    # Bob cannot read Alice's progress, and plants a link to a file only root may read in place of his own.
    peeking = as_learner(bob, f"print(open({str(file)!r}).read())")
    assert peeking.returncode != 0 and "Permission denied" in peeking.stderr, peeking.stdout
    planted = as_learner(bob, '''
        import os
        folder = os.path.expanduser("~/.cache/ddp-helpers/runs")
        os.makedirs(folder, mode=0o700)
        os.symlink("/etc/shadow", os.path.join(folder, "progress.jsonl"))
    ''')
    assert planted.returncode == 0, planted.stderr
    table = subprocess.run([sys.executable, "-m", "ddp_helpers.course.progress", *LEARNERS, "nobody-here"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    header = table.stdout.splitlines()[0]
    assert rows[LEARNERS[0]][header.index("lesson 0"):].startswith("exercise ✓"), table.stdout
    assert "0/0" not in table.stdout and "root:" not in table.stdout
    assert "no progress file" in rows[LEARNERS[1]] and "no progress file" in rows["nobody-here"], table.stdout
    assert rows[LEARNERS[0]][header.index("lesson 1"):].startswith("1/12 checks"), table.stdout
