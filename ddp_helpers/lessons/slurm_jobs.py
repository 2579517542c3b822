"""Watching a plain Slurm job from lesson 4's demonstrations (srun tasks, preemption): a field of
`scontrol show job`, and waiting for a condition with a deadline."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

STILL_GOING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


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
