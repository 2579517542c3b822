"""Lesson 4: preemption. On this machine, the real torchrun's agent is sent SIGTERM mid-training, as Slurm
signals a job it preempts (`run_stopped_by_sigterm`): the workers trap it, save, exit, and the same
command resumes. On Slurm, a job asks for a warning signal before it is stopped (`--signal=B:USR1@T`)
and may be requeued (`--requeue`); on the warning, its training saves a snapshot at the end of the step
and exits, the job script requeues the job, and the requeued job resumes from the snapshot. Run for real
when a Slurm cluster answers (the tests run it on their two-node cluster), with `scancel --signal` standing
in for the scheduler's warning, so that nobody waits for a time limit.

The lesson shows TRAIN_SCRIPT and the job script; the Slurm test holds the notebook's copy of the
training script to this one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ....guarded_torchrun import new_key_line
from ....python_command import python_module_shell
from ....errors import LaunchError
from ..slurm_jobs import cancelled_if_this_process_dies, has_ended, job_field, job_folder, slurm, submit, wait_until

STEPS = 30

TRAIN_SCRIPT = '''\
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

folder = sys.argv[1]  # on storage every node sees: the snapshot must outlive the job
warned, signum_seen = False, None


def on_warning(signum, frame):  # the step ends, then every rank saves and exits together
    global warned, signum_seen
    warned, signum_seen = True, signum


signal.signal(signal.SIGUSR1, on_warning)  # --signal's warning, passed on by the job script
signal.signal(signal.SIGTERM, on_warning)  # preemption: Slurm's SIGTERM, passed on by torchrun's agent too
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
first_step, snapshot_path = 0, os.path.join(folder, "snapshot.pt")
if os.path.exists(snapshot_path):
    snapshot = torch.load(snapshot_path, weights_only=True)
    model.module.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    first_step = snapshot["step"] + 1
    print(f"rank {rank}: resuming at step {first_step} (SLURM_RESTART_COUNT="
          f"{os.environ.get('SLURM_RESTART_COUNT', 0)})", flush=True)

for step in range(first_step, STEPS):
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 2 + rank))
    loss = (model(inputs) - inputs.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step {step} done", flush=True)
    # Every rank stops at the same step: the warning may reach them at different moments.
    stop = torch.tensor([float(warned)])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item() or step == STEPS - 1:
        if rank == 0:  # complete or absent: write, then rename
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       snapshot_path + ".tmp")
            os.replace(snapshot_path + ".tmp", snapshot_path)
        if stop.item() and step < STEPS - 1:
            print(f"rank {rank}: stopped by {signal.Signals(signum_seen).name}, saved after step {step}, exiting", flush=True)
            break
    time.sleep(0.1)  # a slower step: time for the warning to arrive mid-training
dist.destroy_process_group()
'''.replace("STEPS", str(STEPS))


def job_script(train_script: Path, folder: Path, warning_s: int = 60) -> str:
    """The sbatch script: one node, torchrun with 2 ranks; on the warning, pass it to the ranks, wait for
    them to save and exit, and requeue the job."""
    python = shlex.quote(sys.executable)
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --signal=B:USR1@{warning_s}   # SIGUSR1 to this script {warning_s} s before the job is stopped",
        "#SBATCH --requeue                # the job may go back into the queue, and start again from the top",
        "#SBATCH --open-mode=append       # each start adds to the log instead of replacing it",
        f"#SBATCH --output={folder}/job.out",
        "warned=0",
        "trap 'warned=1; echo \"preemption warning: passing it on to the ranks\"; pkill -USR1 -P \"$agent\"' USR1",
        "# torchrun with the two guards a node shared with other users needs (its stores on loopback only, its",
        "# rendezvous state signed with this key): ddp_helpers/guarded_torchrun.py. On a node of your own: torchrun.",
        new_key_line(python),
        f"{python_module_shell('ddp_helpers.guarded_torchrun')} --standalone --nproc-per-node 2 "
        f"--log-dir {shlex.quote(str(folder / 'torchrun-logs'))} {shlex.quote(str(train_script))} "
        f"{shlex.quote(str(folder))} &",
        "agent=$!",
        'while kill -0 "$agent" 2>/dev/null; do wait "$agent"; done   # a trapped signal interrupts wait: wait again',
        'if [ "$warned" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi   # back into the queue, to resume',
        "",
    ])


def run_preempted(after_line: str = "step 5 done", timeout_s: float = 300) -> tuple[str, dict]:
    """Submit TRAIN_SCRIPT's job, send its warning (`scancel --signal=USR1 --batch`) once the log shows
    `after_line`, and wait until the requeued job completes (Slurm holds a requeued job for its
    `AuthInfo=cred_expire` + 1 s before it may start again: 121 s by default, slurm.conf(5)). Returns (the job's log, its
    final snapshot). The job is cancelled if anything goes wrong on the way, the kernel's death included; its
    folder is removed."""
    with job_folder("preemption-") as folder:
        (folder / "train.py").write_text(TRAIN_SCRIPT)
        (folder / "job.sbatch").write_text(job_script(folder / "train.py", folder))
        job_id = submit(folder / "job.sbatch")
        log = folder / "job.out"
        finished = False
        try:
            with cancelled_if_this_process_dies(job_id):
                deadline = time.monotonic() + timeout_s
                wait_until(lambda: log.exists() and after_line in log.read_text(), deadline,
                           f"the job to print {after_line!r}")
                slurm(["scancel", "--signal=USR1", "--batch", job_id])
                wait_until(lambda: job_field(job_id, "Restarts") == "1", deadline, "the job to be requeued")
                wait_until(lambda: has_ended(job_id), deadline, "the requeued job to end")
                state = job_field(job_id, "JobState")
                if state != "COMPLETED":
                    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                                           text=True).stdout
                    raise RuntimeError(f"Slurm job {job_id} ended {state} ({shown.strip()}): {log.read_text()[-1500:]}")
                finished = True
                return log.read_text(), final_snapshot(folder)
        finally:
            if not finished:
                with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError, LaunchError):
                    slurm(["scancel", job_id])


def final_snapshot(folder: Path) -> dict | None:
    """The snapshot TRAIN_SCRIPT last saved in `folder` (None: it saved none)."""
    import torch

    path = folder / "snapshot.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def run_stopped_by_sigterm(after_line: str = "step 5 done", timeout_s: float = 120,
                           script: str = TRAIN_SCRIPT) -> tuple[int | None, str, str, dict | None]:
    """`script` (TRAIN_SCRIPT) under the real torchrun on this machine, its agent sent SIGTERM once the output shows
    `after_line`, as Slurm signals a job it preempts (torchrun passes the signal on to its workers, and
    kills them 30 s later); then the same command again, which resumes. Returns (the first run's exit
    code, its output, the second run's output, the final snapshot); the folder they ran in is removed."""
    with tempfile.TemporaryDirectory(prefix="sigterm-") as name:
        folder = Path(name)
        (folder / "train.py").write_text(script)
        return _stop_and_resume(folder, after_line, timeout_s)


def _stop_and_resume(folder: Path, after_line: str, timeout_s: float) -> tuple[int | None, str, str, dict | None]:
    import signal
    import threading

    from ..plain_torchrun import run_torchrun_command, torchrun_in_background

    command = ["--standalone", "--nproc-per-node", "2", str(folder / "train.py"), str(folder)]
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    with torchrun_in_background(command) as agent:
        # The output line by line, in a thread: a line that never comes must not block the deadline.
        reader = threading.Thread(target=lambda: lines.extend(agent.stdout), daemon=True)
        reader.start()
        wait_until(lambda: not reader.is_alive() or any(after_line in line for line in list(lines)), deadline,
                   f"torchrun's training to print {after_line!r}")
        agent.send_signal(signal.SIGTERM)
        reader.join(max(0.1, deadline - time.monotonic()))
        stopped = agent.wait(max(0.1, deadline - time.monotonic()))
    code, resumed = run_torchrun_command(command, timeout_s=max(10.0, deadline - time.monotonic()))
    if code != 0:
        raise RuntimeError(f"the resumed training failed (exit code {code}): {resumed[-1500:]}")
    return stopped, "".join(lines), resumed, final_snapshot(folder)


def run_uninterrupted_in_background(timeout_s: float = 120) -> concurrent.futures.Future:
    """`run_uninterrupted` in a thread, started now: its `.result()` is the final snapshot. The training mostly sleeps
    between steps, so it runs beside another demo at little cost."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="uninterrupted")
    future = pool.submit(run_uninterrupted, timeout_s)
    pool.shutdown(wait=False)  # the thread ends with its run
    return future


def run_uninterrupted(timeout_s: float = 120) -> dict:
    """The same training run through, on this machine with plain torchrun: its final snapshot."""
    from ..plain_torchrun import run_torchrun_command

    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as name:
        folder = Path(name)
        (folder / "train.py").write_text(TRAIN_SCRIPT)
        code, output = run_torchrun_command(["--standalone", "--nproc-per-node", "2", str(folder / "train.py"),
                                             str(folder)], timeout_s=timeout_s)
        if code != 0:
            raise RuntimeError(f"the uninterrupted training failed (exit code {code}): {output[-1500:]}")
        return final_snapshot(folder)
