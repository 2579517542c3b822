"""Reading a run's outcome: the first failure by time, and torchrun's own report of stopped ranks."""

from pathlib import Path

from ddp_helpers.config import LaunchConfig
from ddp_helpers.result import RankError, RankResult, RunFailed, RunResult

def make_run(ranks, timed_out=False, returncode=1):
    config = LaunchConfig(Path("/tmp/x.py"), len(ranks), "gloo", 60.0, Path("/tmp/x"))
    return RunResult(config, tuple(ranks), 1.0, "gloo", ("cpu",) * len(ranks), returncode, timed_out)


def test_the_first_failure_is_the_earliest_exception_not_the_lowest_rank():
    # Rank 2 raised first; rank 0 then failed in a collective because rank 2 was gone.
    run = make_run([
        RankResult(0, 1, "", "", error=RankError("RuntimeError", "Connection closed by peer", "tb0", time=20.0)),
        RankResult(1, -15, "", ""),
        RankResult(2, 1, "", "", error=RankError("ValueError", "bad batch", "tb2", time=10.0)),
    ])
    assert run.first_failure.rank == 2
    assert not run.ok
    assert [r.status for r in run.ranks] == ["failed (exit code 1)", "stopped (SIGTERM)", "failed (exit code 1)"]
    assert "rank 2 failed first (ValueError: bad batch)" in str(RunFailed(run))
    assert run.summary().splitlines()[1] == "Rank 2 failed first: ValueError: bad batch"


def test_a_timed_out_run_says_so_and_how_to_read_it():
    run = make_run([RankResult(0, None, "", ""), RankResult(1, None, "", "")], timed_out=True, returncode=None)
    assert run.first_failure is None
    assert "timed out after 60 s" in str(RunFailed(run))
    assert "Stacks of the ranks still running are above" in run.summary()
