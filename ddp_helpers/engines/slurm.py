"""Running a launch as a job on a Slurm cluster: `%%torchrun --slurm --nodes 2`, or
`launch(make_launch_config(script, job=SlurmJob(nodes=2)))`. `SlurmJob` is the `engines.Job` (it declares
and validates its own options), `SlurmEngine` the engine the launcher's loop drives. Everything that knows
Slurm is in this module and the commands it runs (`slurm_commands`).

What happens:
- a plain sbatch script is written next to the cell's script (`<name>.sbatch`): one torchrun agent per
  node (`srun torchrun --nnodes $SLURM_NNODES ... --rdzv-backend c10d --rdzv-endpoint <head node's
  address>:<a free port there> --rdzv-id $SLURM_JOB_ID`, run as `guarded_torchrun --signed-only`: the
  rendezvous state, which any user of the cluster could write, is signed with a key the job script draws),
  every rank through `ddp_helpers._bootstrap`, writing its output, exit code and recorded facts into the run
  folder. The run folder must be on a file
  system every node sees (a cluster's home or project folder is); `sbatch <name>.sbatch` by hand runs the
  same job;
- `sbatch --parsable` submits it. A refusal (no Slurm, a bad partition, over a limit) is one LaunchError
  with Slurm's own message;
- while the job waits, the cell says so (job id, state, reason: `squeue`); once it runs, every rank's
  output streams in; at the end the RunResult is built from the run folder as for a local run, each rank
  labelled with its node (the job script hands each node's agent its number and name);
- on timeout, every rank that started is asked for its stack and what it waits in through a file on the
  shared run folder (`_hang_probe`), so the hang report is the same as a local run's;
- the stop button, the timeout, an error here, and the kernel's death all `scancel` the job: a small
  guard process (`slurm_commands.start_guard`) outlives a killed kernel to do it.
  Slurm then ends every process of the job on every node.

Differences from a local run: no warm launch; output is not capped; the ranks' environment is the
submitter's as sbatch passes it on (less its distributed settings), plus the rank contract's exports.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import _hang_probe, hang
from ..errors import LaunchError
from ..guarded_torchrun import SIGNED_ONLY, new_key_line
from ..python_command import python_module_shell
from ..slurm_commands import cancel, cluster_reachable, job_state, start_guard, submit  # noqa: F401 - as lesson 4 names it
from ..run_folder import AGENT_ENV, NODE_ENV, RunFolder, open_private
from . import (DEFAULT_CPU_NPROC, RESERVED_ENV, Ending, Engine, Job, LaunchConfig, LaunchRequest, OutputPump, RankEnding,
               option_text, parse_nproc, rank_command, register_job)

MAX_SLURM_NODES = 64
POLL_INTERVAL_S = 0.5
# Reasons a pending job gives when it can never start as asked (more nodes, time or resources than the
# partition or the account allows): waiting would only run into the timeout.
NEVER_STARTS = ("PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints",
                "ReqNodeNotAvail", "InvalidAccount", "InvalidQOS", "QOSMaxNodePerJobLimit",
                "AssocMaxNodesPerJobLimit", "AssocMaxWallDurationPerJobLimit", "QOSMaxWallDurationPerJobLimit")
# A job cancelled before it ever ran: its final state starts with this, then " (Slurm's reason)".
NEVER_LEFT_THE_QUEUE = "PENDING, never started"


@register_job
@dataclass(frozen=True)
class SlurmJob(Job):
    """Where and how a launch runs on a Slurm cluster: `make_launch_config(script, job=SlurmJob(nodes=2))`.

    Args:
        nodes (int): machines; one torchrun agent on each, `nproc` ranks per machine.
        partition (str | None): sbatch --partition; None: the cluster's default.
        time (str | None): sbatch --time, e.g. "00:10:00"; None: the partition's default.
        gpus_per_node (int | None): sbatch --gpus-per-node; with GPUs the ranks use nccl, one GPU each.
        sbatch_args (tuple[str, ...]): more sbatch options, e.g. ("--account=ml", "--mem=8G").

    nproc defaults to gpus_per_node (nccl) or 2 CPU ranks (gloo) per node.
    """

    label = "Slurm jobs (--slurm)"

    nodes: int = 1
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    sbatch_args: tuple[str, ...] = ()

    @classmethod
    def add_arguments(cls, options) -> None:
        options.add_argument("--slurm", action="store_true",
                             help="submit the cell as a job to the Slurm cluster this machine is a login node of "
                                  "(sbatch), on --nodes machines; the run folder must be on a file system the "
                                  "nodes share")
        options.add_argument("--nodes", default=1, type=int,
                             help="with --slurm: machines, one torchrun agent each (default 1)")
        options.add_argument("--partition", default=None, help="with --slurm: the partition (default: the cluster's)")
        options.add_argument("--time", default=None, help="with --slurm: the job's time limit, e.g. 00:10:00")
        options.add_argument("--gpus-per-node", default=None, type=int,
                             help="with --slurm: GPUs per machine; the ranks then use nccl, one GPU each")
        options.add_argument("--sbatch-args", default=None,
                             help="with --slurm: more sbatch options, quoted, e.g. --sbatch-args '--account=ml "
                                  "--mem=8G'")

    @classmethod
    def from_arguments(cls, args) -> SlurmJob | None:
        if not args.slurm:
            return None
        return cls(nodes=args.nodes, partition=args.partition, time=args.time, gpus_per_node=args.gpus_per_node,
                   sbatch_args=tuple(shlex.split(option_text(args.sbatch_args) or "")))

    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        """A launch on a Slurm cluster: validated against the job's options, not this machine's hardware."""
        self._check()
        gpus = self.gpus_per_node
        backend = request.backend or ("nccl" if gpus else "gloo")  # a named backend was checked already
        if backend == "nccl" and not gpus:
            raise LaunchError("backend 'nccl' on Slurm needs GPUs: give gpus_per_node (magic: --gpus-per-node).")
        nproc = request.nproc
        nproc = parse_nproc(nproc if nproc is not None else (gpus if backend == "nccl" else DEFAULT_CPU_NPROC))
        if backend == "nccl" and nproc > gpus:
            raise LaunchError(f"{nproc} ranks per node but {gpus} GPU(s) per node: with nccl each rank needs its own "
                              "GPU.")
        checked = SlurmJob(self.nodes, self.partition, self.time, gpus, tuple(self.sbatch_args))
        return request.config(checked, ranks_per_agent=nproc, backend=backend, nnodes=self.nodes)

    def _check(self) -> None:
        nodes, gpus = self.nodes, self.gpus_per_node
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_SLURM_NODES:
            raise LaunchError(f"slurm nodes must be a whole number from 1 to {MAX_SLURM_NODES}, got {nodes!r}. "
                              "Example: --nodes 2")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
            raise LaunchError(f"gpus_per_node must be a whole number of GPUs (1 or more), got {gpus!r}.")
        for name, value in (("partition", self.partition), ("time", self.time)):
            if value is not None and (not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.:,\-]+", value)):
                raise LaunchError(f"slurm {name} {value!r} is not a valid value. Example: --partition gpu --time "
                                  "00:10:00")
        if isinstance(self.sbatch_args, str) or not all(isinstance(arg, str) and arg.startswith("--")
                                                        for arg in self.sbatch_args):
            raise LaunchError(f"sbatch_args must be sbatch options, each as one string, got {self.sbatch_args!r}. "
                              "Example: ('--account=ml', '--mem=8G')")

    def engine(self, config: LaunchConfig, folder: RunFolder) -> "SlurmEngine":
        return SlurmEngine(config, folder)


def job_script_path(config: LaunchConfig) -> Path:
    return config.script.with_suffix(".sbatch")


def job_script(config: LaunchConfig, run_id: str) -> str:
    """The sbatch script for `config` (a plain one: `sbatch` it by hand and it runs the same job). The ranks
    get the rank contract (`engines.rank_command`) as exports, on top of the environment sbatch passes on
    from the submitter, less its distributed settings."""
    job = config.job
    python = shlex.quote(sys.executable)
    # A timed-out job's ranks are asked what they wait in through the shared folder, not a named pipe.
    command = rank_command(config, run_id, {_hang_probe.REQUESTS_ENV: "file"})
    options = [f"--job-name=ddp-{config.script.stem}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
               f"--output={RunFolder(config.run_dir).job_log()}"]
    options += [f"--partition={job.partition}"] * bool(job.partition) + [f"--time={job.time}"] * bool(job.time)
    options += [f"--gpus-per-node={job.gpus_per_node}"] * bool(job.gpus_per_node) + list(job.sbatch_args)
    worker = " ".join(shlex.quote(a) for a in command.argv)
    # Each node's agent says which node its ranks run on (Slurm's numbering and the node's name).
    per_node = f"export {AGENT_ENV}=$SLURM_NODEID {NODE_ENV}=$SLURMD_NODENAME; exec \"$@\""
    lines = [
        "#!/bin/bash",
        f"# Generated by ddp_helpers for {config.script.name}: the job a %%torchrun --slurm cell submits.",
        f"# Submit it by hand with: sbatch {job_script_path(config)}",
        "# Every node needs this project and its Python environment at the same paths, and the run folder",
        "# must be on a file system every node sees.",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        f"unset {' '.join(RESERVED_ENV)}",
        *(f"export {name}=\"${{{name}:-{_double_quoted(value)}}}\"" for name, value in command.defaults.items()),
        *(f"export {name}={shlex.quote(value)}" for name, value in command.env.items()),
        f'export PYTHONPATH={shlex.quote(command.python_path)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        "",
        "# The first node hosts the rendezvous: its address (node names need not resolve), and a free port there",
        "# (this script runs on the first node), below the ports the OS hands out, where no connection takes it.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_address=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | cut -d " " -f 1)',
        f"port=$({python_module_shell('ddp_helpers.rendezvous_port')})",
        "# Every user of the cluster can reach that port, and torchrun's agents unpickle the rendezvous state kept",
        "# there: ddp_helpers.guarded_torchrun is torchrun with that state signed by a key only this job holds.",
        new_key_line(python),
        f"cd {shlex.quote(str(config.working_dir))}",
        "",
        f"srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(per_node)} node \\",
        f"    {python_module_shell('ddp_helpers.guarded_torchrun')} {SIGNED_ONLY} \\",
        f"    --nnodes \"$SLURM_NNODES\" --nproc-per-node {config.ranks_per_agent} \\",
        '    --rdzv-backend c10d --rdzv-endpoint "$head_address:$port" --rdzv-id "$SLURM_JOB_ID" \\',
        f"    --max-restarts {config.max_restarts} --log-dir {shlex.quote(str(RunFolder(config.run_dir).torchrun_log_dir))} \\",
        f"    --no-python {python} -u {worker}",
        "",
    ]
    return "\n".join(lines)


def _double_quoted(value: str) -> str:
    """`value` for the inside of a shell's double quotes."""
    return re.sub(r'([\\"$`])', r"\\\1", value)


class SlurmEngine(Engine):
    """Submits the job, says how it waits, cancels it unless it ended (see the module docstring)."""

    poll_interval_s = POLL_INTERVAL_S

    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self.config, self.folder = config, folder
        self.job_id = ""
        self._guard: subprocess.Popen | None = None
        self._said: tuple[str, str] | None = None
        self._final = ""  # Slurm's final state, once the job has left the queue
        self._queued: str | None = None  # while it waits in the queue: why, in Slurm's words ("" if none)

    def start(self, run_id: str) -> None:
        path = job_script_path(self.config)
        with open_private(path, "w") as script:
            script.write(job_script(self.config, run_id))
        self.job_id = submit(path)
        self._guard = start_guard(self.job_id)

    def running(self) -> bool:
        state, detail = job_state(self.job_id)
        if (state, detail) != self._said and state:
            where = f"on {detail}" if state == "RUNNING" else f"({detail})" if detail not in ("", "None") else ""
            print(f"[ddp_helpers] Slurm job {self.job_id}: {state} {where}".rstrip(), flush=True)
            self._said = (state, detail)
        if not state:
            self._final = detail
            return False
        if state == "PENDING" and detail.split(",")[0].strip("()") in NEVER_STARTS:
            raise LaunchError(f"Slurm will not start job {self.job_id} as asked: it waits with reason {detail} "
                              f"(more nodes, time or resources than the partition or account allows). "
                              "The job was cancelled; see `scontrol show partition`.")
        self._queued = (detail if detail not in ("", "None") else "") if state == "PENDING" else None
        return True

    @property
    def stopping(self) -> str:  # the inherited hang report asks the job's ranks through the shared run folder
        return f"cancelling Slurm job {self.job_id}"

    def stop(self) -> None:
        """The job does not outlive the cell: cancelled unless it ended."""
        if self.job_id and not self._final:
            cancel(self.job_id)
        shutil.rmtree(self.folder.torchrun_log_dir, ignore_errors=True)  # torchrun's per-node folders (--log-dir)
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait()

    def ending(self) -> Ending:
        why = f" ({self._queued})" if self._queued else ""
        queued = self._queued is not None
        state = self._final or (f"{NEVER_LEFT_THE_QUEUE}{why}" if queued else "CANCELLED")
        waited = f"Slurm job {self.job_id} was still waiting in the queue{why}" if queued else ""
        return Ending(
            # How each rank said it ended, as it ended (None: it never said: cancelled, or never started).
            ranks=tuple(RankEnding(self.folder.read_exit_code(rank)) for rank in range(self.config.world_size)),
            succeeded=self._final == "COMPLETED",
            reason=state,
            where=f"on {self.config.nnodes} Slurm node(s), job {self.job_id} {state}", never_started=waited,
            launcher_log=self.folder.read_text(self.folder.job_log(self.job_id)) if self.job_id else "",
            job_id=self.job_id,
        )
