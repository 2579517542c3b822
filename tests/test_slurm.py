"""Cells on a real Slurm cluster (two slurmd nodes on this machine, stood up for the session; see
slurm_cluster.py): one world across the nodes with every rank's output and facts back, a failing rank
named, the timeout, the stop button and a killed kernel cancelling the job and leaving no process,
Slurm's own refusal as the error, and the generated job script running with plain sbatch."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ddp_helpers import LaunchError, launch, make_launch_config
from ddp_helpers.course.lessons import slurm_jobs
from ddp_helpers.engines.slurm import SlurmJob
from ddp_helpers.run_folder import RUN_ID_ENV, RunFolder
from slurm_cluster import LocalSlurmCluster, slurm_installed
from support import failure_report, processes_left

WHO = """
import os
import torch
import torch.distributed as dist
from ddp_helpers import record

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank()])
dist.all_reduce(total)
record("sum", total.item())
record("world", dist.get_world_size())
print(f"rank {dist.get_rank()} on {os.environ['SLURMD_NODENAME']}")
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    raise ValueError("rank fails on purpose")
dist.destroy_process_group()
"""

SLEEPER = """
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print("started", flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))  # which no other rank calls: where the stop report finds rank 0
time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster():
    if not slurm_installed():
        pytest.fail("Slurm is not installed: apt-get install --no-install-recommends slurmd slurmctld slurm-client "
                    "(.ci/run does it)")
    if os.geteuid() != 0:
        pytest.fail("The Slurm tests run a two-node cluster on this machine as root (munged, slurmctld, slurmd): "
                    "run them as root, as CI does")
    base = Path(tempfile.mkdtemp(prefix="ddp-lessons-slurm-"))
    running = LocalSlurmCluster(base).start()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(running.conf)
    yield running
    running.stop()
    shutil.rmtree(base, ignore_errors=True)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


def wait_until(condition, timeout_s, what):
    """Poll `condition` for up to `timeout_s`; TimeoutError naming `what` (lesson 4's poller, by duration)."""
    slurm_jobs.wait_until(condition, time.monotonic() + timeout_s, f"{what} (within {timeout_s} s)")


def test_a_two_node_cell_makes_one_world_with_every_ranks_output_and_facts(cluster, ipython, capsys):
    shell = ipython
    result = shell.run_cell(f"%%torchrun --slurm --nodes 2 -n 2 --name who --out who --timeout 90\n{WHO}")
    assert result.success, result.error_in_exec
    run = shell.user_ns["who"]
    assert run.ok and run.job_state == "COMPLETED", failure_report(run)
    assert run.facts("sum") == [6] * 4 and run.facts("world") == [4] * 4
    assert {r.node for r in run.ranks} == {"n1", "n2"}
    for r in run.ranks:
        assert f"rank {r.rank} on {r.node}" in r.stdout
    shown = capsys.readouterr().out
    assert f"Slurm job {run.job_id}: RUNNING" in shown and "rank 3 on n" in shown
    job_script = run.config.script.with_suffix(".sbatch")
    assert "srun" in job_script.read_text() and "--rdzv-id \"$SLURM_JOB_ID\"" in job_script.read_text()
    assert not cluster.jobs()


def test_a_failing_rank_is_named(cluster, write_script):
    config = make_launch_config(write_script("who", WHO), job=SlurmJob(nodes=2), nproc=2, timeout_s=90,
                                stream=False, extra_env={"FAIL_RANK": "3"})
    run = launch(config)
    assert not run.ok and run.job_state == "FAILED", failure_report(run)
    assert run.first_failure.rank == 3 and "ValueError: rank fails on purpose" in run.summary()


def test_the_timeout_cancels_the_job_and_leaves_no_process(cluster, write_script):
    config = make_launch_config(write_script("sleeper", SLEEPER), job=SlurmJob(nodes=2), nproc=2, timeout_s=12,
                                stream=False)
    run = launch(config)
    assert run.timed_out and not run.ok, failure_report(run)
    assert not cluster.jobs(), "the job must be cancelled"
    wait_until(lambda: not processes_left(RUN_ID_ENV, run.run_id), 15, "no process of the job is left")


def test_a_job_still_queued_at_the_timeout_says_it_never_started_and_why(cluster, write_script):
    # --begin holds the job in the queue (reason BeginTime) however idle the cluster is.
    config = make_launch_config(write_script("who", WHO), job=SlurmJob(nodes=2, sbatch_args=("--begin=now+1hour",)),
                                nproc=2, timeout_s=10, stream=False)  # time for Slurm to give the reason
    run = launch(config)
    assert run.timed_out and not run.ok
    assert "BeginTime" in run.job_state, run.job_state
    summary = run.summary()
    assert f"while Slurm job {run.job_id} was still waiting in the queue (BeginTime): it never started" in summary
    assert "rank 0: never started" in summary and "Where each rank still running was" not in summary
    assert not cluster.jobs(), "the job must be cancelled"


LAUNCHING_PROCESS = textwrap.dedent(
    """
    import signal
    import sys
    # The stop button is SIGINT, which a Jupyter kernel always handles, whatever started the tests (a
    # background job of a script starts with SIGINT ignored, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.engines.slurm import SlurmJob
    config = make_launch_config(sys.argv[1], job=SlurmJob(nodes=2), nproc=2, timeout_s=200, stream=True,
                                run_dir=sys.argv[2])
    try:
        launch(config)
    except KeyboardInterrupt:
        print("launcher saw KeyboardInterrupt", flush=True)
        sys.exit(130)
    """
)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["stop button", "kernel killed"])
def test_stopping_the_cell_or_killing_the_kernel_cancels_the_job(cluster, write_script, tmp_path, how):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHING_PROCESS, str(write_script("sleeper", SLEEPER)),
                                 str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: all("started" in _read(run_dir / f"rank{r}.stdout") for r in range(4)), 90,
                   "every rank of the job runs")
        run_id = (run_dir / ".ddp_helpers-run").read_text()
        marker = run_id.split('"run_id": "')[1].split('"')[0]
        assert processes_left(RUN_ID_ENV, marker)
        launcher.send_signal(how)
        wait_until(lambda: not cluster.jobs(), 30, "the job is cancelled")
        wait_until(lambda: not processes_left(RUN_ID_ENV, marker), 15, "no process of the job is left")
        if how == signal.SIGINT:  # and the stop button says where each rank was, as a timeout does
            said = launcher.communicate(timeout=60)[0]
            assert "launcher saw KeyboardInterrupt" in said
            assert "What each rank was waiting in when the run was stopped" in said, said
            assert re.search(r"^0 +all_reduce +#\d+", said, re.M), said
    finally:
        launcher.kill()
        launcher.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_job_slurm_refuses_is_one_error_with_slurms_message(cluster, write_script):
    config = make_launch_config(write_script("who", WHO), job=SlurmJob(nodes=2, partition="nope"), stream=False)
    with pytest.raises(LaunchError, match=r"Slurm did not accept the job:\n.*invalid partition"):
        launch(config)
    config = make_launch_config(write_script("who", WHO), job=SlurmJob(nodes=5), stream=False)
    with pytest.raises(LaunchError, match=r"Slurm will not start job \d+ as asked: it waits with reason "
                                          r"\w*(PartitionConfig|NodeLimit)"):
        launch(config)
    assert not cluster.jobs(), "the job that could never start is cancelled"


def job_end_state(job_id: str, timeout_s: float = 120) -> str:
    """The state a job ends in, from plain `scontrol` (Slurm keeps an ended job for MinJobAge, 300 s)."""
    wait_until(lambda: slurm_jobs.has_ended(job_id), timeout_s, f"job {job_id} to end")
    return slurm_jobs.job_field(job_id, "JobState")


def test_the_generated_job_script_runs_with_plain_sbatch(cluster, write_script, tmp_path):
    # Each node's torchrun keeps its per-run folder in the run folder (--log-dir), removed at the end, not in the
    # node's temporary folder (TMPDIR here, which the job inherits).
    temporary = tmp_path / "node-tmp"
    temporary.mkdir()
    # And the job's working folder holds a `ddp_helpers` planted there: no process of the job may import it.
    work, proof = tmp_path / "work", tmp_path / "proof"
    (work / "ddp_helpers").mkdir(parents=True)
    proof.mkdir()
    (work / "ddp_helpers" / "__init__.py").write_text(f"open({str(proof)!r} + '/' + str(__import__('os').getpid()), 'w')\n")
    config = make_launch_config(write_script("who", WHO), job=SlurmJob(nodes=2), nproc=1, timeout_s=90, stream=False,
                                extra_env={"TMPDIR": str(temporary)}, cwd=work)
    first = launch(config)
    assert first.ok, failure_report(first)
    assert list(temporary.iterdir()) == [] and not RunFolder(first.run_dir).torchrun_log_dir.exists()
    assert list(proof.iterdir()) == [], "a process of the job imported the package planted in its working folder"
    for stale in first.run_dir.glob("rank*"):
        stale.unlink()
    job_script = config.script.with_suffix(".sbatch")
    submitted = subprocess.run(["sbatch", "--parsable", str(job_script)], capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    # Polled here rather than with `sbatch --wait`, whose polls back off to one every 10 s.
    assert job_end_state(submitted.stdout.strip().split(";")[0]) == "COMPLETED"
    outputs = sorted(first.run_dir.glob("rank*.stdout"))
    assert [p.name for p in outputs] == ["rank0.stdout", "rank1.stdout"]
    assert "rank 1 on n" in outputs[1].read_text()


def test_the_lessons_srun_tasks_make_one_world_without_torchrun(cluster):
    """Deep dive 4b's script for one srun task per rank (shown in the notebook) maps Slurm's variables to a
    world of 2 nodes × 2 tasks, run with plain sbatch and srun."""
    import nbformat

    from ddp_helpers.course.lessons.lesson4.srun import TASK_SCRIPT, run_as_srun_tasks
    from support import course_notebook

    cells = nbformat.read(course_notebook("04b_clusters_in_depth.ipynb"), as_version=4).cells
    shown = next(cell.source for cell in cells if cell.get("id") == "lesson4-srun-tasks")
    assert f"```python\n{TASK_SCRIPT.rstrip()}\n```" in shown, "the lesson must show the script it runs"
    outputs = run_as_srun_tasks(nodes=2, tasks_per_node=2, timeout_s=120)
    assert outputs == {rank: f"rank {rank} of 4, local rank {rank % 2} on node {rank // 2}: sum of ranks 6\n"
                       for rank in range(4)}, outputs


def test_the_lessons_preempted_job_saves_requeues_and_resumes_bitwise(cluster):
    """Deep dive 4b's preemption: warned with SIGUSR1 (scancel --signal standing in for --signal=B:USR1@T), the
    job saves, requeues itself and resumes; every step runs once, and it ends bitwise where the same
    training without a warning ends. The notebook shows this training script."""
    import nbformat
    import torch

    from ddp_helpers.course.lessons.lesson4.preemption import STEPS, TRAIN_SCRIPT, run_preempted, run_uninterrupted
    from support import course_notebook

    cells = nbformat.read(course_notebook("04b_clusters_in_depth.ipynb"), as_version=4).cells
    shown = next(cell.source for cell in cells if cell.get("id") == "lesson4-preemption")
    assert f"```python\n{TRAIN_SCRIPT.rstrip()}\n```" in shown, "the lesson must show the training it runs"
    log, preempted = run_preempted(after_line="step 5 done")
    assert "preemption warning" in log and "SLURM_RESTART_COUNT=1" in log, log
    steps = [int(step) for step in re.findall(r"^step (\d+) done", log, flags=re.M)]
    assert steps == list(range(STEPS)), log
    assert re.search(r"saved after step (\d+)", log) and "resuming at step" in log, log
    uninterrupted = run_uninterrupted()
    assert preempted["step"] == uninterrupted["step"] == STEPS - 1
    for name, value in uninterrupted["model"].items():
        assert torch.equal(preempted["model"][name], value), name


def test_a_hang_on_slurm_is_reported_with_its_cause_and_stacks(cluster, write_script):
    """As warm and cold launches do (tests/test_hang.py): the job's ranks are asked through the shared run
    folder before the job is cancelled."""
    from test_hang import HANGS, PREAMBLE

    body, cause = HANGS["a collective one rank never calls"]
    config = make_launch_config(write_script("hangs", PREAMBLE + body), job=SlurmJob(nodes=1), nproc=2,
                                timeout_s=30, stream=False)
    run = launch(config)
    assert run.timed_out and run.hang is not None, failure_report(run)
    assert cause in run.hang.cause, f"{run.hang.text()}\n{failure_report(run)}"
    assert all("where rank" in rank.stderr for rank in run.ranks), failure_report(run)
    assert not cluster.jobs(), "the job must be cancelled"


def test_a_pickle_written_into_a_jobs_rendezvous_store_is_refused_unread(cluster, write_script, tmp_path):
    """A job's rendezvous store listens on the nodes' network, where every user of the cluster reaches it; the
    state torchrun's agents unpickle there is signed with a key the job script draws, so a pickle written by
    anyone else (here the attacker of tests/test_shared_machine.py) is refused before it is unpickled."""
    import threading

    from test_shared_machine import ATTACKER

    script = write_script("waits_for_the_attack", SLEEPER)
    config = make_launch_config(script, job=SlurmJob(nodes=2), nproc=1, timeout_s=120, stream=False)
    result = {}
    launch_thread = threading.Thread(target=lambda: result.update(run=launch(config)))
    launch_thread.start()
    attacker, proof = tmp_path / "attacker.py", tmp_path / "proof"
    attacker.write_text(ATTACKER)
    try:
        deadline, port = time.monotonic() + 90, None
        while port is None and time.monotonic() < deadline and launch_thread.is_alive():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    continue
                if "--rdzv-endpoint" in argv and str(script) in argv:  # this job's agent
                    port = argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1]
            time.sleep(0.2)
        assert port, "the job's agent was not found"
        attack = subprocess.run([sys.executable, str(attacker), str(proof), port], capture_output=True, text=True,
                                timeout=90)
        assert "wrote torch.rendezvous." in attack.stdout, f"the attack never reached the store: {attack.stdout}"
    finally:
        launch_thread.join(180)  # the refused state fails the job, or the timeout ends it
    run = result["run"]
    job_log = RunFolder(run.run_dir).job_log(run.job_id).read_text(errors="replace")
    assert not proof.exists(), f"the pickle ran as the learner: {proof.read_text()}"
    assert "does not carry this job's signature" in job_log, job_log[-3000:] + failure_report(run)



KERNEL_WAITING_FOR_A_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ddp_helpers.course.lessons.slurm_jobs import cancelled_if_this_process_dies, submit
    job_id = submit(Path(sys.argv[1]))
    with cancelled_if_this_process_dies(job_id):  # as lesson 4's preemption and srun demos wait for theirs
        print(job_id, flush=True)
        time.sleep(300)
    """
)


def test_a_kernel_killed_while_lesson_4_waits_for_its_job_cancels_the_job(cluster, tmp_path):
    """As a %%torchrun --slurm cell's job is (test_stopping_the_cell_or_killing_the_kernel_cancels_the_job): the
    lesson's own jobs do not run on, requeue and all, after the kernel that waited for them died."""
    job_script = tmp_path / "sleeps.sbatch"
    job_script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/job.out\nsleep 300\n")
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL_WAITING_FOR_A_JOB, str(job_script)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_id = kernel.stdout.readline().strip()
    try:
        assert job_id in cluster.jobs(), job_id + kernel.stdout.read()
        kernel.kill()
        assert job_end_state(job_id, timeout_s=30) == "CANCELLED"
    finally:
        kernel.kill()
        kernel.wait()
        subprocess.run(["scancel", job_id], capture_output=True, timeout=15)
