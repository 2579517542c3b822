"""Rank hooks (`ddp_helpers.rank_hooks`): a plain launch runs none of the course's code in its ranks, a course
launch (`%load_ext ddp_helpers.course`) keeps the records its checkers judge by, and the bootstrap names no hook."""

import pytest

from ddp_helpers import rank_hooks
from ddp_helpers.course import EVIDENCE_HOOK
from support import failure_report, run_on_cpu
from ddp_helpers.course.records import RankRecords, records

WHAT_RUNS = """
import os, sys
import torch
import torch.distributed as dist
from ddp_helpers import record
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(2))
torch.save({"x": 1}, "saved.pt")
# Another rank's output, read: the course's audit hook notes it (a crossing); a plain launch installs none.
open(os.path.join(os.environ["DDP_HELPERS_RUN_DIR"], f"rank{1 - dist.get_rank()}.stdout")).read()
record("loaded", sorted(m for m in sys.modules if m.startswith("ddp_helpers")))
record("save_wrapped", hasattr(torch.save, "__wrapped__"))
record("has_secret", "DDP_HELPERS_RANK_SECRET" in os.environ)
dist.destroy_process_group()
"""
COURSE_MODULES = ("ddp_helpers.course.evidence_hook", "ddp_helpers.course._all_reduce_log", "ddp_helpers.course._channel_bytes",
                  "ddp_helpers.course", "ddp_helpers.course.exercises", "ddp_helpers.course.checks", "ddp_helpers.course.lessons")


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_a_plain_launch_runs_no_course_code_in_its_ranks(write_script, monkeypatch, cold):
    monkeypatch.setattr(rank_hooks, "_IN_USE", [])  # as in a notebook that loaded `ddp_helpers` alone
    run = run_on_cpu(write_script("plain", WHAT_RUNS), cold=cold, stream=False)
    assert run.ok, failure_report(run)
    for rank in run.ranks:
        assert not [m for m in rank.facts["loaded"] if m.startswith(COURSE_MODULES)], rank.facts["loaded"]
        assert not rank.facts["save_wrapped"] and not rank.facts["has_secret"]
    assert all(seen == RankRecords(seen.rank) for seen in records(run)), records(run)


def test_a_course_launch_keeps_the_records_its_checkers_judge(write_script):
    # Warm only: the suite's checker tests judge cold course launches by these records already.
    assert EVIDENCE_HOOK in rank_hooks.in_use()  # conftest, as a lesson's first cell
    run = run_on_cpu(write_script("course", WHAT_RUNS), stream=False)
    assert run.ok, failure_report(run)
    for rank, seen in zip(run.ranks, records(run)):
        assert EVIDENCE_HOOK in rank.facts["loaded"] and rank.facts["save_wrapped"] and rank.facts["has_secret"]
        assert any(path.endswith("saved.pt") for path in seen.files_written), seen.files_written
        assert [c["op"] for c in seen.collectives] == ["all_reduce"]
        assert seen.crossings == (f"opened rank{1 - rank.rank}.stdout",), seen.crossings


def test_an_exercise_run_without_the_courses_records_is_told_how_to_get_them(write_script, monkeypatch):
    from ddp_helpers.course.exercises import ExerciseReport, rank_secrets

    monkeypatch.setattr(rank_hooks, "_IN_USE", [])
    run = run_on_cpu(write_script("plain", "print('hello')\n"), stream=False)
    report = ExerciseReport()
    assert rank_secrets(run, report) is None
    assert "%load_ext ddp_helpers.course" in report.mistakes[0], report.mistakes


def test_a_runs_records_are_its_own_after_a_later_launch_into_its_folder(write_script, monkeypatch):
    """Read as each launch ends, a run's records stay its own when the next launch reuses its folder; one read back
    before the course's reader was registered finds nothing of the later launch's (secrets included)."""
    from ddp_helpers import readback

    script = write_script("course", WHAT_RUNS)
    first, second = run_on_cpu(script, stream=False), run_on_cpu(script, stream=False)
    assert first.run_dir == second.run_dir and first.ok and second.ok, failure_report(first)
    mine, theirs = records(first), records(second)
    assert [seen.secret for seen in mine] != [seen.secret for seen in theirs] and None not in [s.secret for s in mine]
    assert all(seen.collectives for seen in mine)

    monkeypatch.setattr(readback, "_READERS", [])  # as if the course were loaded after these launches
    unread, later = run_on_cpu(script, stream=False), run_on_cpu(script, stream=False)
    assert unread.run_dir == later.run_dir
    assert all(seen == RankRecords(seen.rank) for seen in records(unread)), records(unread)
    assert all(seen.secret is not None for seen in records(later))
