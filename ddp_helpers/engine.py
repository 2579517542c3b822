"""The seam between the launcher's one follow loop (`launcher.launch`) and what runs the ranks: an engine.

The launcher owns what every launch shares: claiming the run folder, streaming each rank's output, the
deadline, stopping in `finally` (normal end, timeout, the stop button, any error), and reading the run
back into a `RunResult`. An engine owns how the ranks are started, watched and stopped:

- `local_engine.LocalEngine`: torchrun agents on this machine (cold or warm, one or several agents);
- `slurm.SlurmEngine`: a job on a Slurm cluster;
- a third one (another scheduler) is one new module: a `ClusterJob` (what `make_launch_config(cluster=...)`
  takes; it validates its own options into a `LaunchConfig`) and the `Engine` it makes. `tests/fake_engine.py`
  is such a module: it runs each rank as a plain subprocess, through the same loop.

Whatever engine ran it, the ranks write the same run folder (`run_folder.RunFolder`), through
`ddp_helpers._bootstrap`, so the read-back is the same.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: config imports this module, not the other way round
    from .config import LaunchConfig
    from .output import RankOutputStreamer
    from .run_folder import RunFolder


@dataclass(frozen=True)
class LaunchRequest:
    """What `make_launch_config` checked before it hands a cluster launch to its `ClusterJob`.

    Args:
        script (Path): the script, resolved; it exists.
        timeout_s (float): checked: positive and finite.
        run_dir (Path | None): as given (None: the default run folder for the script).
        cwd (Path | None): resolved; a folder.
        extra_env (Mapping[str, str]): checked names and string values.
        script_args (tuple[str, ...]): as strings.
        stream (bool), max_restarts (int): checked.
        nproc (object), backend (str | None): as given (a backend, when given, is one of config.BACKENDS):
            ranks per node and backend depend on the job, not on this machine.
        local_options (tuple[str, ...]): options given that only a run on this machine has (nnodes, kill_rank,
            join_after, cold): a cluster job refuses them, naming its own.
    """

    script: Path
    timeout_s: float
    run_dir: Path | None
    cwd: Path | None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    script_args: tuple[str, ...] = ()
    stream: bool = True
    max_restarts: int = 0
    nproc: object = None
    backend: str | None = None
    local_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ending:
    """How the engine saw the run end, for `readback.collect_result`.

    Args:
        returncode (int | None): the launcher process's exit code (the supervisor's; 0 or 1 for a job).
        launcher_log (str | None): the launcher's own log; None: the run folder's torchrun log.
        job_state (str), job_id (str): a scheduler's final state and job id ("" on this machine).
    """

    returncode: int | None
    launcher_log: str | None = None
    job_state: str = ""
    job_id: str = ""


class Engine(abc.ABC):
    """Runs one launch's ranks. The launcher calls `start`, then `running` until it is False or the deadline
    passes (then `on_timeout`), then `stop` (always, once), then `ending`."""

    #: how often the launcher polls (and streams output) while the run goes on
    poll_interval_s: float = 0.05

    @abc.abstractmethod
    def start(self, run_id: str) -> None:
        """Start the ranks of run `run_id` (the run folder is claimed and emptied)."""

    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the run goes on. May raise LaunchError when it can never end well (stop still runs)."""

    def on_timeout(self, streamer: RankOutputStreamer) -> None:
        """The deadline passed and the run still goes on: what to gather before it is stopped."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop whatever of the run still lives, within a bound; nothing of the run survives it. Called once,
        after a normal end too. Pressing stop again meanwhile must not cut it short: an interrupt is raised
        again at the end."""

    @abc.abstractmethod
    def ending(self) -> Ending:
        """After `stop`: how the run ended."""


class ClusterJob(abc.ABC):
    """A launch somewhere other than this machine: `make_launch_config(script, cluster=SomeJob(...))`."""

    @abc.abstractmethod
    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        """Validate the job's own options against `request` and return the launch (raise LaunchError, naming
        the fix, otherwise). The returned config's `cluster` is the job, as checked."""

    @abc.abstractmethod
    def engine(self, config: LaunchConfig, folder: RunFolder) -> Engine:
        """The engine that runs `config` into `folder`."""
