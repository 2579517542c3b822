"""A third engine, as a new scheduler would bring one, in one file and with no edit in ddp_helpers: a `Job`
that declares its own `%%torchrun` option (--plain-processes) and checks its own options, and the `Engine`
the launcher's loop drives. It "runs" each rank as a plain subprocess (no torchrun, no agent), started with
the rank contract every engine uses (`engines.rank_command`): enough to prove that `launcher.launch` and the
magic follow any engine the same way (options, streaming, deadline, stop, read-back, the learner's modules),
and that it gets the hang report and the waiting line without a line of its own for them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from ddp_helpers.engines import (Ending, Engine, Job, LaunchConfig, LaunchRequest, RankEnding, parse_nproc,
                                 rank_command, register_job)
from ddp_helpers.errors import LaunchError
from ddp_helpers.processes import kill_process_groups
from ddp_helpers.run_folder import RunFolder
from support import free_port


@register_job
@dataclass(frozen=True)
class PlainProcessesJob(Job):
    """Every rank a plain `python -m ddp_helpers._bootstrap SCRIPT` with RANK and WORLD_SIZE set."""

    label = "plain processes (--plain-processes)"

    @classmethod
    def add_arguments(cls, options) -> None:
        options.add_argument("--plain-processes", action="store_true",
                             help="run each rank as a plain process, without torchrun (a test's engine)")

    @classmethod
    def from_arguments(cls, args) -> PlainProcessesJob | None:
        return cls() if args.plain_processes else None

    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        if request.backend not in (None, "gloo"):
            raise LaunchError("plain processes run on CPU: backend 'gloo' only.")
        return request.config(self, ranks_per_agent=parse_nproc(request.nproc or 2), backend="gloo")

    def engine(self, config: LaunchConfig, folder: RunFolder) -> Engine:
        return PlainProcessesEngine(config, folder)


class PlainProcessesEngine(Engine):
    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self.config, self.folder = config, folder
        self.processes: list[subprocess.Popen] = []

    def start(self, run_id: str) -> None:
        config = self.config
        command = rank_command(config, run_id)
        port = free_port()  # for a script that makes a process group (env://)
        for rank in range(config.world_size):
            env = {**command.environment(), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(config.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self.processes.append(subprocess.Popen([sys.executable, *command.argv], env=env, cwd=config.working_dir,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def stop(self) -> None:
        kill_process_groups([process.pid for process in self.processes if process.poll() is None])
        for process in self.processes:
            process.wait()

    def ending(self) -> Ending:
        ranks = tuple(RankEnding(process.returncode) for process in self.processes)
        return Ending(ranks=ranks, succeeded=all(rank.exit_code == 0 for rank in ranks), where="as plain processes",
                      launcher_log="(plain processes: no launcher log)")
