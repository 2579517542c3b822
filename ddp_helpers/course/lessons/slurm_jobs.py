"""Plain Slurm jobs for lesson 4's demonstrations (srun tasks, preemption): the folder a job works in,
submitting one, running a Slurm command, a field of `scontrol show job`, and waiting for a condition with a
deadline."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ...python_command import python_module_command

STILL_GOING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


@contextlib.contextmanager
def job_folder(prefix: str) -> Iterator[Path]:
    """A new folder of the learner's alone for one job's files, under the runs root: the folder that must be on
    a file system every node sees, as for the %%torchrun cells' Slurm jobs. Removed when the block ends."""
    from ...private_folders import private_folder
    from ...run_folder import demo_jobs_root

    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=private_folder(demo_jobs_root())))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def cancelled_if_this_process_dies(job_id: str) -> Iterator[None]:
    """While the block runs, a guard process (the %%torchrun Slurm engine's) cancels the job if this process dies
    first (a killed kernel): the job does not run on without anyone to read it. Started by its command line, not
    through `engines.slurm`, which no lesson imports (tests/test_structure.py: engines sit behind the seam)."""
    guard = subprocess.Popen(python_module_command("ddp_helpers.engines.slurm", "GUARD", str(os.getpid()), job_id),
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        guard.kill()
        guard.wait()


def slurm(command: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm command; RuntimeError with Slurm's own words if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def submit(job_script: Path) -> str:
    """`sbatch` the script: its job id."""
    return slurm(["sbatch", "--parsable", str(job_script)]).stdout.strip().split(";")[0]


def job_field(job_id: str, field: str) -> str:
    """One field of `scontrol -o show job JOB_ID` ("" when Slurm no longer knows the job, or lacks the field)."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith(f"{field}=")), "")


def has_ended(job_id: str) -> bool:
    state = job_field(job_id, "JobState")
    return bool(state) and state not in STILL_GOING


def wait_until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `condition` until it holds; TimeoutError naming `what` once `deadline` (time.monotonic) passes."""
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.3)
