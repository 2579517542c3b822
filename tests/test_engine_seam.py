"""The launcher's one follow loop drives any engine: a third engine (tests/fake_engine.py, each rank a plain
subprocess, one file with no edit in ddp_helpers) gets streaming, the read-back, the root cause, the deadline
and the stop from `launch` alone, and its own %%torchrun option from the magic; every engine starts its ranks
with the one rank contract (`engines.rank_command`)."""

import os

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
    run = launch(make_launch_config(write_script("who", WHO), nproc=3, job=PlainProcessesJob()))
    streamed = capsys.readouterr().out
    assert [r.facts["who"] for r in run.ranks] == [{"rank": r, "world": 3} for r in range(3)]
    assert "[rank 2] hello from rank 2 of 3" in streamed
    assert not run.ok and [r.exit_code for r in run.ranks] == [0, 1, 0]
    assert run.first_failure.rank == 1 and run.first_failure.error.type == "ValueError"
    assert run.launcher_log == "(plain processes: no launcher log)"


def test_the_loops_deadline_stops_a_third_engines_ranks(write_script):
    run = launch(make_launch_config(write_script("sleeper", SLEEPER), nproc=2, timeout_s=6, stream=False,
                                    job=PlainProcessesJob()))
    assert run.timed_out and not run.ok
    assert all("sleeping" in r.stdout for r in run.ranks)
    pids = _rank_pids(run)
    assert pids and all(process_is_dead(pid) for pid in pids), "the stop left a rank running"


def test_a_third_engine_gets_the_hang_report_without_writing_one(write_script):
    """The engine base asks the ranks' probe threads (`Engine.on_timeout`): the fake engine has no hang code."""
    from test_hang import HANGS, PREAMBLE

    body, cause = HANGS["a collective one rank never calls"]
    run = launch(make_launch_config(write_script("hangs", PREAMBLE + body), nproc=2, timeout_s=15, stream=False,
                                    job=PlainProcessesJob()))
    assert run.timed_out and run.hang is not None, run.summary()
    assert cause in run.hang.cause, run.hang.text()
    assert all("where rank" in rank.stderr for rank in run.ranks), [rank.stderr[-300:] for rank in run.ranks]


def test_a_job_checks_its_own_options_and_refuses_another_jobs(write_script):
    with pytest.raises(LaunchError, match=r"nnodes is for runs on this machine, not for plain processes \(--plain"):
        make_launch_config(write_script("who", WHO), nnodes=2, job=PlainProcessesJob())
    with pytest.raises(LaunchError, match="backend 'gloo' only"):
        make_launch_config(write_script("who", WHO), backend="nccl", job=PlainProcessesJob())
    with pytest.raises(LaunchError, match=r"job must be a job \(an engines.Job\), got str"):
        make_launch_config(write_script("who", WHO), job="slurm")


def test_a_third_engine_declares_its_option_and_runs_a_cell_that_imports_beside_the_notebook(ipython, tmp_path,
                                                                                             monkeypatch, capsys):
    # Registered by importing tests/fake_engine.py (above), after %load_ext: the magic offers its option at
    # the next cell, and its ranks import a module beside the notebook, as a local run's do.
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "model_beside.py").write_text("WHO = 'beside the notebook'\n")
    monkeypatch.chdir(tmp_path / "course")
    ipython.run_cell("%torchrun --help")
    assert "--plain-processes" in capsys.readouterr().out
    result = ipython.run_cell("%%torchrun --plain-processes -n 3 --name plain --out plain\n"
                              "import os, sys, model_beside\nfrom ddp_helpers import record\n"
                              "record('seen', [model_beside.WHO, os.environ['RANK'], 'torch.distributed.run' in sys.modules])\n")
    assert result.success, result.error_in_exec
    run = ipython.user_ns["plain"]
    assert run.facts("seen") == [["beside the notebook", str(rank), False] for rank in range(3)]
    assert "3 rank(s) as plain processes" in run.summary()


def test_an_option_of_a_job_not_chosen_says_whose_it_is(ipython):
    result = ipython.run_cell("%%torchrun --plain-processes --kill-rank 1 --kill-after 'x'\npass\n")
    assert "--kill-rank is for runs on this machine, not for plain processes" in str(result.error_in_exec)
    both = ipython.run_cell("%%torchrun --plain-processes --slurm\npass\n")
    assert "choose one" in str(both.error_in_exec)


def test_every_engine_starts_its_ranks_with_the_one_rank_contract(tmp_path):
    from ddp_helpers.engines import LaunchConfig, rank_command
    from ddp_helpers.engines.local.engine import child_environment
    from ddp_helpers.engines.slurm import SlurmJob, job_script

    config = LaunchConfig(tmp_path / "train.py", 2, "gloo", 60.0, tmp_path / "run", job=SlurmJob(nodes=2),
                          extra_env={"MINE": "1"}, import_dir=tmp_path / "course", nnodes=2)
    command = rank_command(config, "abc")
    theirs = {"PYTHONPATH": "/theirs", "RANK": "7", "OMP_NUM_THREADS": "4"}
    env = command.environment(theirs)
    assert env["PYTHONPATH"].split(os.pathsep) == [command.python_path, "/theirs"], "prepended, not replaced"
    assert "RANK" not in env and env["OMP_NUM_THREADS"] == "4" and env["MINE"] == "1"
    assert env["DDP_HELPERS_IMPORT_DIR"] == str(tmp_path / "course") and env["DDP_HELPERS_RUN_ID"] == "abc"
    local = child_environment(config, "abc", theirs)
    hooks = "DDP_HELPERS_RANK_HOOKS"
    assert {key: local[key] for key in env if key != hooks} == {key: value for key, value in env.items() if key != hooks}, \
        "the local engine adds to the contract, never changes it"
    # Its rank hooks: the engine's own first, then its client's (the course's, which conftest turns on).
    assert local[hooks].split(",") == ["ddp_helpers.engines.local.rank_hook", *env[hooks].split(",")]
    script = job_script(config, "abc")
    for name, value in command.env.items():
        assert f"export {name}=" in script and value in script
    assert f"export PYTHONPATH={command.python_path}" in script and " ".join(command.argv[:2]) in script


def _rank_pids(run) -> list[int]:
    from ddp_helpers.run_folder import RunFolder

    return RunFolder(run.config.run_dir, run.run_id).rank_pids(run.config.world_size)


def test_the_supervisor_gets_one_spec_that_round_trips_through_the_run_folder(tmp_path):
    from ddp_helpers.engines.local.supervisor_spec import SupervisorSpec

    spec = SupervisorSpec(parent_pid=123, run_id="abc", shutdown_grace_s=3, nnodes=2, ranks_per_agent=2, max_restarts=1,
                          worker=("-m", "ddp_helpers._bootstrap", "train.py"), log_dir=str(tmp_path / "logs"),
                          join_after="step 5 done", agent_gpus=("0,1", "2,3"))
    spec.write(tmp_path / "supervisor.json")
    assert SupervisorSpec.read(tmp_path / "supervisor.json") == spec
    argv = spec.torchrun_argv(rendezvous_port=4321)
    assert argv[argv.index("--nnodes") + 1] == "1:2"  # elastic: agents join later
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:4321"
    assert argv[-3:] == ["-m", "ddp_helpers._bootstrap", "train.py"] and spec.world_size == 4


def test_the_launch_phases_benchmark_accounts_for_the_whole_launch(write_script):
    # The benchmark's phases run from launch() called to launch() returned, each ending at a moment the run
    # recorded itself; they must tile the launch (no phase negative, the sum the wall time).
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "launch_phases.py"
    spec = importlib.util.spec_from_file_location("launch_phases", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    wall, phases = benchmark.one_launch(write_script("barrier", benchmark.SCRIPT), 2)
    # (A file's time comes from the kernel's coarse clock, up to a few ms behind time.time().)
    assert len(phases) == len(benchmark.PHASES) and all(phase > -0.02 for phase in phases), phases
    assert abs(sum(phases) - wall) < 1e-6
    assert 0 < benchmark.one_floor(2) < wall
