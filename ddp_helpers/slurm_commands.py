"""Slurm's client commands as the launcher's Slurm engine and lesson 4's demonstrations run them: submitting a job,
its state, one field of it, cancelling it, and a guard process that cancels it if the kernel waiting for it dies.
The one place besides the Slurm engine that knows Slurm (tests/test_structure.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import LaunchError
from .python_command import python_module_command

# A job in one of these states has not ended.
STILL_GOING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
CANCEL_WAIT_S = 30
QUERY_TIMEOUT_S = 20  # squeue against a controller that is down hangs about 10 s


def cluster_reachable(timeout_s: float = 5) -> bool:
    """Whether a Slurm controller answers from here (`sinfo`), within `timeout_s`."""
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


def run_command(command: list[str]) -> subprocess.CompletedProcess:
    """Run one of Slurm's commands; LaunchError when it is not installed or the controller does not answer."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except FileNotFoundError:
        raise LaunchError(f"{command[0]} was not found: Slurm's client commands are not installed here (or not on "
                          "PATH). Run the notebook on the cluster's login node, or drop --slurm.") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{command[0]} got no answer in {QUERY_TIMEOUT_S} s: is the Slurm controller up?") from None


def run_or_raise(command: list[str]) -> subprocess.CompletedProcess:
    """`run_command`, and LaunchError with Slurm's own words when the command fails."""
    done = run_command(command)
    if done.returncode != 0:
        raise LaunchError(f"{' '.join(command)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def submit(path: Path) -> str:
    """sbatch the script; its job id, or LaunchError with Slurm's own message."""
    done = run_command(["sbatch", "--parsable", str(path)])
    if done.returncode != 0:
        message = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
        if not cluster_reachable():
            message += ("\nNo Slurm controller answers from this machine (sinfo): it is not a login node of a "
                        "cluster. Run the notebook on the cluster's login node, or drop --slurm to run here.")
        raise LaunchError(f"Slurm did not accept the job:\n{message}")
    return done.stdout.strip().split(";")[0]


def job_field(job_id: str, field: str) -> str:
    """One field of `scontrol -o show job JOB_ID` ("" when Slurm no longer knows the job, or lacks the field)."""
    shown = run_command(["scontrol", "-o", "show", "job", job_id]).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith(f"{field}=")), "")


def has_ended(job_id: str) -> bool:
    state = job_field(job_id, "JobState")
    return bool(state) and state not in STILL_GOING


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason or node list) while the job is known to Slurm; ("", "") once it is gone."""
    done = run_command(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
    fields = done.stdout.strip().split("|") if done.returncode == 0 and done.stdout.strip() else []
    if len(fields) == 3:
        state, reason, nodes = fields
        return state, (nodes if state == "RUNNING" else reason)
    state = job_field(job_id, "JobState")
    return (state, "") if state in STILL_GOING else ("", state)


def cancel(job_id: str, wait_s: float = CANCEL_WAIT_S) -> None:
    """scancel the job and wait until Slurm no longer lists it as running."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=QUERY_TIMEOUT_S)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and job_state(job_id)[0]:
        time.sleep(0.2)


def start_guard(job_id: str) -> subprocess.Popen:
    """A process that cancels the job if this one dies before it is killed (a killed kernel): the job does not
    run on without anyone to read it. Kill it (and wait) once the job ended or was cancelled."""
    return subprocess.Popen(python_module_command(__name__, "GUARD", str(os.getpid()), job_id),
                            stdin=subprocess.DEVNULL, start_new_session=True)


@contextlib.contextmanager
def cancelled_if_this_process_dies(job_id: str) -> Iterator[None]:
    """`start_guard` for the time the block runs."""
    guard = start_guard(job_id)
    try:
        yield
    finally:
        guard.kill()
        guard.wait()


def _guard(kernel_pid: int, job_id: str) -> int:
    """Cancels the job if the kernel dies before the job ends; the launcher kills this process otherwise."""
    from .processes import ARM_PARENT_DEATH_FAILED, arm_parent_death_signal

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    if arm_parent_death_signal(signal.SIGTERM, kernel_pid) == ARM_PARENT_DEATH_FAILED:
        stop.append(True)
    while not stop:
        time.sleep(0.5)
    cancel(job_id)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "GUARD":
        sys.exit(_guard(int(sys.argv[2]), sys.argv[3]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'ddp_helpers.slurm_commands'} GUARD KERNEL_PID JOB_ID")
