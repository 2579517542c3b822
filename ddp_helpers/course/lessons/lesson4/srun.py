"""Lesson 4: one `srun` task per rank, without torchrun. The training script that maps Slurm's variables
to rank, local rank and world size, the job script that starts it, and a run of both on a Slurm cluster
when one answers from here (the tests run it on their two-node cluster).

The lesson shows TASK_SCRIPT in a markdown block; tests/test_slurm.py keeps the two the same.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ....python_command import python_module_shell
from ....errors import LaunchError
from ..slurm_jobs import cancelled_if_this_process_dies, has_ended, job_field, job_folder, slurm, submit, wait_until

TASK_SCRIPT = '''\
import os

import torch
import torch.distributed as dist

rank = int(os.environ["SLURM_PROCID"])         # this task's number in the job step: the global rank
local_rank = int(os.environ["SLURM_LOCALID"])  # its number on its node: the GPU it takes
world_size = int(os.environ["SLURM_NTASKS"])   # every task of the step
if torch.cuda.is_available():  # a task bound to its own GPU sees only that one, as cuda:0
    torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
# MASTER_ADDR and MASTER_PORT come from the job script; rank and world size are given here,
# since srun does not set RANK and WORLD_SIZE.
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)
total = torch.tensor([float(rank)], device="cuda" if torch.cuda.is_available() else "cpu")
dist.all_reduce(total)
print(f"rank {rank} of {world_size}, local rank {local_rank} on node {os.environ['SLURM_NODEID']}: "
      f"sum of ranks {total.item():.0f}", flush=True)
dist.destroy_process_group()
'''


def job_script(task_script: Path, output_dir: Path, nodes: int, tasks_per_node: int) -> str:
    """The sbatch script: one task per rank on each node, the first node's address as MASTER_ADDR."""
    python = shlex.quote(sys.executable)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}   # one task per rank (on GPUs, add --gpus-per-task=1)",
        f"#SBATCH --output={output_dir}/job.out",
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export MASTER_ADDR=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | cut -d " " -f 1)',
        f"export MASTER_PORT=$({python_module_shell('ddp_helpers.rendezvous_port')})  # free now, outside the OS's ephemeral range",
        f"srun --kill-on-bad-exit=1 --output={output_dir}/task%t.out {python} {shlex.quote(str(task_script))}",
        "",
    ])


def run_as_srun_tasks(nodes: int = 2, tasks_per_node: int = 2, timeout_s: float = 120) -> dict[int, str]:
    """Submit TASK_SCRIPT as a job of `nodes` × `tasks_per_node` srun tasks, wait for it to end, and return
    each task's output by its task number. Raises RuntimeError with Slurm's words if it does not complete;
    the job is cancelled if the wait ends any other way (a timeout, the stop button, the kernel's death)."""
    with job_folder("srun-tasks-") as folder:
        task_script = folder / "train.py"
        task_script.write_text(TASK_SCRIPT)
        (folder / "job.sbatch").write_text(job_script(task_script, folder, nodes, tasks_per_node))
        job_id = submit(folder / "job.sbatch")
        ended = False
        try:
            with cancelled_if_this_process_dies(job_id):
                wait_until(lambda: has_ended(job_id), time.monotonic() + timeout_s,
                           f"Slurm job {job_id} to end (cancelled)")
                state = job_field(job_id, "JobState")
                ended = True
        finally:
            if not ended:
                with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError, LaunchError):
                    slurm(["scancel", job_id])
        outputs = {int(path.stem.removeprefix("task")): path.read_text() for path in folder.glob("task*.out")}
        job_log = (folder / "job.out").read_text() if (folder / "job.out").exists() else ""
    if state != "COMPLETED":
        raise RuntimeError(f"Slurm job {job_id} ended {state}: {job_log[-1000:]} {outputs}")
    return dict(sorted(outputs.items()))
