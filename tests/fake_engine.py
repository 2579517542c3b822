"""A third engine, as a new scheduler would bring one: a `ClusterJob` that checks its own options and the
`Engine` the launcher's loop drives. It "runs" each rank as a plain subprocess (no torchrun, no agent):
enough to prove that `launcher.launch` follows any engine the same way (streaming, deadline, stop, read-back)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_helpers.config import LaunchConfig, default_run_dir, inherited_environment, parse_nproc
from ddp_helpers.engine import ClusterJob, Ending, Engine, LaunchRequest
from ddp_helpers.errors import LaunchError
from ddp_helpers.processes import kill_process_groups
from ddp_helpers.run_folder import RUN_DIR_ENV, RUN_ID_ENV, RunFolder

PROJECT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PlainProcessesJob(ClusterJob):
    """Every rank a plain `python -m ddp_helpers._bootstrap SCRIPT` with RANK and WORLD_SIZE set."""

    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        if request.local_options:
            raise LaunchError(f"{request.local_options[0]} is not for plain processes.")
        if request.backend not in (None, "gloo"):
            raise LaunchError("plain processes run on CPU: backend 'gloo' only.")
        return LaunchConfig(
            script=request.script, ranks_per_agent=parse_nproc(request.nproc or 2), backend="gloo",
            timeout_s=request.timeout_s, run_dir=request.run_dir or default_run_dir(request.script),
            extra_env=request.extra_env, script_args=request.script_args, stream=request.stream, cwd=request.cwd,
            warm=False, cluster=self,
        )

    def engine(self, config: LaunchConfig, folder: RunFolder) -> Engine:
        return PlainProcessesEngine(config, folder)


class PlainProcessesEngine(Engine):
    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self.config, self.folder = config, folder
        self.processes: list[subprocess.Popen] = []

    def start(self, run_id: str) -> None:
        config = self.config
        for rank in range(config.world_size):
            env = {**inherited_environment(), **config.extra_env, RUN_DIR_ENV: str(config.run_dir), RUN_ID_ENV: run_id,
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(config.world_size),
                   "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(PROJECT)}
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "ddp_helpers._bootstrap", str(config.script), *config.script_args],
                env=env, cwd=config.working_dir, stdin=subprocess.DEVNULL, start_new_session=True))

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def stop(self) -> None:
        kill_process_groups([process.pid for process in self.processes if process.poll() is None])
        for process in self.processes:
            process.wait()

    def ending(self) -> Ending:
        return Ending(returncode=max((abs(p.returncode) for p in self.processes), default=0) and 1,
                      launcher_log="(plain processes: no launcher log)")
