"""The launcher's one follow loop drives any engine: a third engine (tests/fake_engine.py, each rank a plain
subprocess) gets streaming, the read-back, the root cause, the deadline and the stop from `launch` alone."""

import pytest

from ddp_helpers import LaunchError, launch, make_launch_config
from ddp_helpers.processes import process_is_dead
from fake_engine import PlainProcessesJob

WHO = """
import os, sys
from ddp_helpers import record
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"hello from rank {rank} of {world}")
record("who", {"rank": rank, "world": world})
if rank == 1:
    raise ValueError("rank 1 fails on purpose")
"""

SLEEPER = """
import time
print("sleeping", flush=True)
time.sleep(600)
"""


def test_a_third_engine_is_followed_streamed_and_read_back_by_the_same_loop(write_script, capsys):
    run = launch(make_launch_config(write_script("who", WHO), nproc=3, cluster=PlainProcessesJob()))
    streamed = capsys.readouterr().out
    assert [r.facts["who"] for r in run.ranks] == [{"rank": r, "world": 3} for r in range(3)]
    assert "[rank 2] hello from rank 2 of 3" in streamed
    assert not run.ok and [r.exit_code for r in run.ranks] == [0, 1, 0]
    assert run.first_failure.rank == 1 and run.first_failure.error.type == "ValueError"
    assert run.launcher_log == "(plain processes: no launcher log)"


def test_the_loops_deadline_stops_a_third_engines_ranks(write_script):
    run = launch(make_launch_config(write_script("sleeper", SLEEPER), nproc=2, timeout_s=6, stream=False,
                                    cluster=PlainProcessesJob()))
    assert run.timed_out and not run.ok
    assert all("sleeping" in r.stdout for r in run.ranks)
    pids = _rank_pids(run)
    assert pids and all(process_is_dead(pid) for pid in pids), "the stop left a rank running"


def test_a_cluster_job_checks_its_own_options(write_script):
    with pytest.raises(LaunchError, match="nnodes is not for plain processes"):
        make_launch_config(write_script("who", WHO), nnodes=2, cluster=PlainProcessesJob())
    with pytest.raises(LaunchError, match="cluster must be a cluster job"):
        make_launch_config(write_script("who", WHO), cluster="slurm")


def _rank_pids(run) -> list[int]:
    from ddp_helpers.run_folder import RunFolder

    return RunFolder(run.config.run_dir, run.run_id).rank_pids(run.config.world_size)


def test_the_supervisor_gets_one_spec_that_round_trips_through_the_run_folder(tmp_path):
    from ddp_helpers.supervisor_spec import SupervisorSpec

    spec = SupervisorSpec(parent_pid=123, run_id="abc", shutdown_grace_s=3, nnodes=2, ranks_per_agent=2, max_restarts=1,
                          worker=("-m", "ddp_helpers._bootstrap", "train.py"), log_dir=str(tmp_path / "logs"),
                          join_after="step 5 done", agent_gpus=("0,1", "2,3"))
    spec.write(tmp_path / "supervisor.json")
    assert SupervisorSpec.read(tmp_path / "supervisor.json") == spec
    argv = spec.torchrun_argv(rendezvous_port=4321)
    assert argv[argv.index("--nnodes") + 1] == "1:2"  # elastic: agents join later
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:4321"
    assert argv[-3:] == ["-m", "ddp_helpers._bootstrap", "train.py"] and spec.world_size == 4
