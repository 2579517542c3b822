"""Reading a run's outcome: the first failure by time, and torchrun's own report of stopped ranks."""

from pathlib import Path

from ddp_helpers.engines import LaunchConfig
from ddp_helpers.result import RankError, RankResult, RunFailed, RunResult

def make_run(ranks, timed_out=False, job_succeeded=False, stream=False):
    config = LaunchConfig(Path("/tmp/x.py"), len(ranks), "gloo", 60.0, Path("/tmp/x"), stream=stream)
    return RunResult(config, tuple(ranks), 1.0, "gloo", ("cpu",) * len(ranks), job_succeeded, timed_out)


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
    assert run.summary().splitlines()[1] == "Rank 2 failed first, the root cause: ValueError: bad batch"


def test_a_timed_out_run_says_so_and_how_to_read_it():
    stack = "[ddp_helpers] where rank {rank} was when the run timed out:\n  File ..."
    run = make_run([RankResult(rank, None, "", stack.format(rank=rank)) for rank in (0, 1)], timed_out=True,
                   job_succeeded=False)
    assert run.first_failure is None
    assert "timed out after 60 s" in str(RunFailed(run))
    assert "Where each rank still running was is shown above" in run.summary()
    # No stack to point to: the summary does not say one is shown.
    never_started = make_run([RankResult(rank, None, "", "", agent=None) for rank in (0, 1)], timed_out=True,
                             job_succeeded=False)
    assert "No rank had started its script yet" in never_started.summary()
    no_stack = make_run([RankResult(rank, None, "", "", agent=0) for rank in (0, 1)], timed_out=True, job_succeeded=False)
    assert "No rank's stack could be taken" in no_stack.summary() and "shown above" not in no_stack.summary()


def test_a_rank_killed_by_a_signal_is_the_root_cause_of_the_peer_that_noticed_it_first():
    # Rank 1 noticed rank 0's death (connection closed) a few ms before the supervisor's 20 ms poll saw it.
    run = make_run([
        RankResult(0, -9, "", "", ended_at=10.015),
        RankResult(1, 1, "", "", error=RankError("RuntimeError", "Connection closed by peer [127.0.0.1]:9135",
                                                 "tb1", time=10.0)),
        RankResult(2, -15, "", "", ended_at=10.01),
    ])
    assert run.first_failure.rank == 0
    late = make_run([  # a signal long after the peer's error is not its cause
        RankResult(0, -9, "", "", ended_at=15.0),
        RankResult(1, 1, "", "", error=RankError("RuntimeError", "Connection closed by peer", "tb1", time=10.0)),
    ])
    assert late.first_failure.rank == 1


def test_a_job_that_never_left_the_queue_says_so_in_its_engines_words():
    from dataclasses import replace

    run = replace(make_run([RankResult(0, None, "", ""), RankResult(1, None, "", "")], timed_out=True, job_succeeded=False),
                  job_id="42", never_started="Slurm job 42 was still waiting in the queue (Resources)")
    summary = run.summary()
    assert "while Slurm job 42 was still waiting in the queue (Resources): it never started" in summary
    assert "Where each rank still running was" not in summary
    assert "rank 0: never started" in summary and "rank 1: never started" in summary


def test_a_rank_stopped_by_sigterm_yields_to_the_rank_killed_at_the_same_moment():
    # Seen under load: the supervisor's death watcher saw rank 0 (SIGTERMed by torchrun) and rank 1
    # (SIGKILLed, the real cause) dead in the same look; the lower rank won the tie.
    run = make_run([RankResult(0, -15, "", "", ended_at=5.0), RankResult(1, -9, "", "", ended_at=5.0),
                    RankResult(2, -15, "", "", ended_at=5.0)])
    assert run.first_failure.rank == 1
    # A SIGTERM that came alone, from outside, is still the cause.
    alone = make_run([RankResult(0, -15, "", "", ended_at=5.0), RankResult(1, 0, "", "")])
    assert alone.first_failure.rank == 0


def test_a_rank_that_raised_the_same_error_itself_is_not_called_a_consequence():
    def traceback(line):
        return f'Traceback (most recent call last):\n  File "/r/cell.py", line {line}, in <module>\n    x = rows["id"]\nKeyError: \'id\'\n'

    run = make_run([
        RankResult(0, 1, "", "", error=RankError("KeyError", "'id'", traceback(3), time=10.0)),
        RankResult(1, 1, "", "", error=RankError("KeyError", "'id'", traceback(3), time=10.1)),
        RankResult(2, 1, "", "", error=RankError("KeyError", "'id'", traceback(7), time=10.2)),
        RankResult(3, 1, "", "", error=RankError("RuntimeError", "Connection closed by peer", "tb3", time=10.3)),
        RankResult(4, 1, "", "", error=RankError("KeyboardInterrupt", "", "tb4", time=9.0)),
    ])
    lines = run.summary().splitlines()
    assert lines[1] == "Rank 4 failed first, the root cause: KeyboardInterrupt"
    shifted = make_run(run.ranks[:4])
    summary = shifted.summary()
    assert "rank 1: failed (exit code 1): KeyError: 'id', the same error as rank 0's, raised on this rank too" in summary
    assert "rank 2: failed (exit code 1): KeyError: 'id', a consequence of rank 0's failure" in summary  # another line
    assert "rank 3: failed (exit code 1): RuntimeError: Connection closed by peer, a consequence of rank 0's failure" in summary
    # Streamed, each of those errors was shown above as a line of its own: the summary says only how it relates.
    streamed = make_run(run.ranks[:4], stream=True).summary()
    assert "  rank 3: failed (exit code 1), a consequence of rank 0's failure" in streamed.splitlines()
    assert streamed.count("Connection closed by peer") == 0


def test_the_root_cause_is_one_line_in_the_summary_its_whole_message_in_the_traceback():
    # TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch message is about 700 characters: the traceback above has it.
    long = "Detected mismatch between collectives on ranks. " + "CollectiveFingerPrint(...) " * 30 + "\nsecond line"
    run = make_run([RankResult(0, 1, "", "", error=RankError("RuntimeError", long, "tb0", time=1.0))])
    line = run.summary().splitlines()[1]
    assert line.startswith("Rank 0 failed first, the root cause: RuntimeError: Detected mismatch") and line.endswith("...")
    assert len(line) <= len("Rank 0 failed first, the root cause: ") + 300 and "second line" not in run.summary()


def test_a_root_cause_that_lost_its_peer_names_the_ranks_that_had_finished():
    # Uneven inputs under gloo: rank 0 ran out of batches and exited; rank 1's next backward lost it.
    closed = "[pair.cc:553] Connection closed by peer [127.0.0.1]:55998. This is typically caused by a remote worker crashing."
    run = make_run([RankResult(0, 0, "", ""),
                    RankResult(1, 1, "", "", error=RankError("RuntimeError", closed, "tb1", time=1.0))])
    lines = run.summary().splitlines()
    assert lines[2].startswith("Its peer went away: rank(s) [0] had finished their script normally (exit code 0)")
    crashed = make_run([RankResult(0, -9, "", "", ended_at=0.5),
                        RankResult(1, 1, "", "", error=RankError("RuntimeError", closed, "tb1", time=5.0))])
    assert "Its peer went away" not in crashed.summary()  # a peer that crashed is no normal finish


def test_a_ranks_gpu_is_numbered_on_its_own_machine(tmp_path):
    """Two machines of 2 GPUs each: ranks 2 and 3 have cuda:0 and cuda:1 on theirs, not cuda:2 and cuda:3."""
    from ddp_helpers.engines import Ending, LaunchConfig, RankEnding
    from ddp_helpers.engines.local.job import LocalJob
    from ddp_helpers.readback import collect_result
    from ddp_helpers.run_folder import RankIdentity, RunFolder

    folder = RunFolder(tmp_path / "run", "abc")
    folder.path.mkdir()
    for rank in range(3):  # rank 3 never started: its place on its agent
        folder.write_identity(RankIdentity(rank=rank, pid=100 + rank, agent=rank // 2, group_rank=rank // 2,
                                           local_rank=rank % 2, world_size=4))
    config = LaunchConfig(tmp_path / "train.py", 2, "nccl", 60.0, folder.path, job=LocalJob(nnodes=2), nnodes=2)
    ending = Ending(ranks=tuple(RankEnding(0) for _ in range(4)), succeeded=True)
    run = collect_result(config, folder, ending, wall_time_s=1.0, timed_out=False)
    assert run.devices == ("cuda:0", "cuda:1", "cuda:0", "cuda:1")
