"""Plain Slurm jobs for lesson 4's demonstrations (srun tasks, preemption): the folder a job works in and waiting
for a condition with a deadline; Slurm's commands themselves are the launcher's (`slurm_commands`), as its Slurm
engine runs them."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ...slurm_commands import (  # noqa: F401 - the lesson's demonstrations name them here
    STILL_GOING, cancelled_if_this_process_dies, has_ended, job_field, submit,
)
from ...slurm_commands import run_or_raise as slurm  # noqa: F401 - a Slurm command; LaunchError with Slurm's words if it fails


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


def wait_until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `condition` until it holds; TimeoutError naming `what` once `deadline` (time.monotonic) passes."""
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.3)
