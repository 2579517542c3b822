"""The seam between the launcher's one follow loop (`launcher.follow`) and what runs the ranks: jobs and
their engines.

A `Job` says where a launch runs and checks its own options, its `%%torchrun` options included
(`add_arguments`, `from_arguments`); its `Engine` starts, watches and stops the ranks. Every engine starts
each rank with what `rank_command` says (the bootstrap running the script, the run's markers, the import
folder, the environment filter and defaults): the rank contract, stated once, here. The launcher owns what
every launch shares: claiming the run folder, streaming each rank's output, the deadline, stopping in
`finally`, and reading the run back (`readback`) from the run folder the ranks wrote and the engine's
`Ending`, never from an engine's own files.

The built-in engines are the modules of this package, each registering its job as it loads:
- `local`: torchrun agents on this machine, cold or warm: the default job;
- `slurm`: a job on a cluster's scheduler.
A third engine is one module anywhere: a `Job` subclass decorated with `register_job`, and its `Engine`.
`tests/fake_engine.py` is one (each rank a plain process), with a `%%torchrun` option of its own.
"""

from __future__ import annotations

import abc
import importlib
import os
import pkgutil
import re
import sys
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from .. import hang, rank_hooks
from ..errors import LaunchError
from ..python_command import python_module
from ..run_folder import IMPORT_DIR_ENV, RUN_DIR_ENV, RUN_ID_ENV, RunFolder, default_run_dir
from ..torch_compat import rank_environment

#: the module every rank runs, which then runs the script
BOOTSTRAP = "ddp_helpers._bootstrap"

DEFAULT_CPU_NPROC = 2
BACKENDS = ("gloo", "nccl")
# Variables the launcher sets itself (or torchrun sets per rank): inherited ones are dropped, and extra_env
# may not set them.
RESERVED_ENV_PREFIXES = ("DDP_HELPERS_", "TORCHELASTIC_")
RESERVED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)


def max_cpu_ranks() -> int:
    """More CPU ranks than this on one machine would only thrash it (each imports torch: ~300 MB)."""
    return max(8, 4 * (os.cpu_count() or 1))


def parse_nproc(value: object) -> int:
    """Turn user input ("4", 4) into a rank count, or raise LaunchError saying what is accepted."""
    if isinstance(value, bool):
        value = str(value)
    try:
        nproc = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise LaunchError(
            f"nproc must be a whole number of processes (1 or more), got {value!r}. Example: --nproc 2"
        ) from None
    if nproc < 1:
        raise LaunchError(f"nproc must be 1 or more processes, got {nproc}. Example: --nproc 2")
    if nproc > max_cpu_ranks():
        raise LaunchError(
            f"nproc {nproc} is more processes than this machine can run ({os.cpu_count()} CPU cores; at most "
            f"{max_cpu_ranks()} ranks here, each one a Python process with torch). Example: --nproc 2"
        )
    return nproc


def option_text(value: str | None) -> str | None:
    """A `%%torchrun` option's text without the quotes around it (--kill-after "'step 5 done'")."""
    if value and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def inherited_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without the variables a launcher or torchrun sets: a
    kernel started under torchrun would otherwise pass its own RANK, MASTER_PORT, ... to the ranks."""
    return {key: value for key, value in (os.environ if base is None else base).items()
            if key not in RESERVED_ENV and not key.startswith(RESERVED_ENV_PREFIXES)}


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of a script on `world_size` ranks under torchrun: `nnodes` agents (one per machine, real
    or standing for one), each starting `ranks_per_agent` ranks. What every job shares; what only one job
    has (a kill, a warm start, a partition) is a field of `job`.

    Args:
        script (Path): the Python file every rank runs.
        ranks_per_agent (int): ranks (processes) each agent starts (torchrun's --nproc-per-node).
        backend (str): "gloo" (CPU processes) or "nccl" (one GPU per rank).
        timeout_s (float): the run is stopped, with what every rank waits in, after this long.
        run_dir (Path): per-run output (each rank's stdout/stderr, recorded facts); emptied at launch,
            and only if ddp_helpers made it (see `run_folder`).
        job (Job | None): where and how the launch runs (`make_launch_config` always sets it; None only in
            a config made by hand that is never launched).
        extra_env (Mapping[str, str]): environment variables added for every rank.
        script_args (tuple[str, ...]): command-line arguments passed to the script.
        stream (bool): print each rank's output live, prefixed by its rank.
        cwd (Path | None): the ranks' working directory; None: the run folder.
        max_restarts (int): how many times torchrun restarts all ranks after one fails (its
            --max-restarts); 0: a failure ends the run.
        nnodes (int): torchrun agents, one per machine: on this machine, agents on loopback standing for
            machines; on a cluster, its nodes.
        import_dir (Path | None): a folder on the ranks' sys.path after the script's own (a %%torchrun
            cell's notebook folder: what the kernel imports from there, the cell's ranks import too).

    Build it with `make_launch_config`, which fills in defaults and validates.
    """

    script: Path
    ranks_per_agent: int
    backend: str
    timeout_s: float
    run_dir: Path
    job: Job | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    script_args: tuple[str, ...] = ()
    stream: bool = True
    cwd: Path | None = None
    max_restarts: int = 0
    nnodes: int = 1
    import_dir: Path | None = None

    @property
    def working_dir(self) -> Path:
        return self.cwd or self.run_dir

    @property
    def world_size(self) -> int:
        return self.ranks_per_agent * self.nnodes

    def __post_init__(self) -> None:
        # Freeze the environment mapping too, so a config can be shared without surprises.
        object.__setattr__(self, "extra_env", types.MappingProxyType(dict(self.extra_env)))


@dataclass(frozen=True)
class LaunchRequest:
    """What `make_launch_config` checked, whatever job runs it; the job checks the rest and calls `config`.

    Args:
        script (Path): the script, resolved; it exists.
        timeout_s (float): checked: positive and finite.
        run_dir (Path | None): as given (None: the default run folder for the script).
        cwd (Path | None): resolved; a folder.
        extra_env (Mapping[str, str]): checked names and string values.
        script_args (tuple[str, ...]): as strings.
        stream (bool), max_restarts (int): checked.
        nproc (object), backend (str | None): as given (a backend, when given, is one of BACKENDS): ranks
            per machine and backend depend on the job.
        import_dir (Path | None): resolved.
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
    import_dir: Path | None = None

    def config(self, job: Job, *, ranks_per_agent: int, backend: str, nnodes: int = 1,
               extra_env: Mapping[str, str] | None = None) -> LaunchConfig:
        """The launch of this request by `job`, with what the job decided (`extra_env`: the request's, with
        the job's additions)."""
        return LaunchConfig(
            script=self.script, ranks_per_agent=ranks_per_agent, backend=backend, timeout_s=self.timeout_s,
            run_dir=self.run_dir or default_run_dir(self.script), job=job,
            extra_env=self.extra_env if extra_env is None else extra_env, script_args=self.script_args,
            stream=self.stream, cwd=self.cwd, max_restarts=self.max_restarts, nnodes=nnodes,
            import_dir=self.import_dir)


@dataclass(frozen=True)
class RankCommand:
    """How every rank of a launch is started, whatever engine starts it.

    Args:
        argv (tuple[str, ...]): what follows the Python interpreter: the bootstrap, the script, its arguments.
        env (Mapping[str, str]): set for every rank, over what it inherits.
        defaults (Mapping[str, str]): set for every rank where its environment does not set them.
        python_path (str): put first on PYTHONPATH, before whatever is there: the folder holding ddp_helpers.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    defaults: Mapping[str, str]
    python_path: str

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A rank's whole environment on top of `base` (default: this process's), its distributed settings
        dropped (`inherited_environment`)."""
        env = inherited_environment(base)
        for key, value in self.defaults.items():
            env.setdefault(key, value)
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.python_path, env.get("PYTHONPATH")) if p)
        return env


def rank_command(config: LaunchConfig, run_id: str, engine_env: Mapping[str, str] | None = None,
                 hooks: tuple[str, ...] = ()) -> RankCommand:
    """The rank contract of launch `run_id`: every rank runs `python -P -m ddp_helpers._bootstrap SCRIPT ARGS`
    (`argv` is what follows the interpreter: `python_command.python_module`, the working folder off sys.path)
    with the run folder and the run's id in its environment (and the import folder, if any), unbuffered
    output, `config.extra_env`, and `engine_env` (what only this engine's ranks need) last. Its rank hooks
    (`rank_hooks`): the engine's own `hooks`, then those its process's client uses (`rank_hooks.use`)."""
    defaults = {
        "OMP_NUM_THREADS": "1",  # torchrun sets 1 thread per rank anyway (and warns)
        "MPLBACKEND": "Agg",  # ranks have no display; a kernel's inline backend would drag IPython in
        **rank_environment(),  # the flight recorder on, whatever the torch (torch_compat)
    }
    if config.max_restarts or config.nnodes > 1:
        # Without it the agent's shared store keeps the dead ranks' addresses and restarts fail to connect
        # (pytorch issues 135712, 167288): 7 of 10 restarts failed here, 0 of 12 with it. Agents joining or
        # leaving a rendezvous need it too.
        defaults["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env = {**config.extra_env, RUN_DIR_ENV: str(config.run_dir), RUN_ID_ENV: run_id,
           **({IMPORT_DIR_ENV: str(config.import_dir)} if config.import_dir else {}),
           "PYTHONUNBUFFERED": "1", **(engine_env or {})}
    named = ",".join(dict.fromkeys((*hooks, *rank_hooks.in_use())))
    if named:
        env[rank_hooks.HOOKS_ENV] = named
    argv = (*python_module(BOOTSTRAP), str(config.script), *config.script_args)
    return RankCommand(argv=argv, env=env, defaults=defaults, python_path=_PACKAGE_PARENT)


@dataclass(frozen=True)
class RankEnding:
    """How one rank ended, as its engine saw it: `exit_code` 0, a failure's code, minus a signal's number,
    or None (unknown: stopped before it could say); `died_at` when it was seen dead (time.time())."""

    exit_code: int | None
    died_at: float | None = None


@dataclass(frozen=True)
class Ending:
    """How the engine saw the run end, for `readback.collect_result`.

    Args:
        ranks (tuple[RankEnding, ...]): one per rank the run had (an elastic run's: as many as it grew to).
        succeeded (bool): the engine saw the whole run end well.
        reason (str): the engine's word for how it ended, shown in the summary (a scheduler's final state
            or why it waited); "" when there is nothing to add.
        where (str): how the summary says where the run ran, e.g. "on 2 agents" ("" on one agent here).
        never_started (str): if it never started, the sentence's subject: "Slurm job 42 was still waiting in
            the queue (Resources)".
        launcher_log (str): the launcher's own output (torchrun's log, a job's output file).
        job_id (str): a scheduler's id for the run ("" here).
    """

    ranks: tuple[RankEnding, ...]
    succeeded: bool
    reason: str = ""
    where: str = ""
    never_started: str = ""
    launcher_log: str = ""
    job_id: str = ""


class OutputPump(Protocol):
    """What an engine may do with the launcher's output streaming while it waits: show what came in."""

    def poll(self) -> None: ...


class Engine(abc.ABC):
    """Runs one launch's ranks. The launcher calls `start`, then `running` until it is False or the deadline
    passes (then `on_timeout`), then `stop` (always, once), then `ending`. An engine keeps its launch's
    `config` (LaunchConfig) and `folder` (RunFolder) as attributes: the hang report and the waiting line,
    which every engine inherits, read them."""

    config: LaunchConfig
    folder: RunFolder

    #: how often the launcher polls (and streams output) while the run goes on
    poll_interval_s: float = 0.05

    @abc.abstractmethod
    def start(self, run_id: str) -> None:
        """Start the ranks of run `run_id` (the run folder is claimed and emptied), each with
        `rank_command(config, run_id)`."""

    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the run goes on. May raise LaunchError when it can never end well (stop still runs)."""

    def wait_for_end(self, seconds: float) -> None:
        """Between two polls: return after `seconds`, or as soon as the run ended, where the engine can tell."""
        time.sleep(seconds)

    def ranks_to_ask(self) -> list[int]:
        """The ranks a timeout, a stop press or the waiting line asks: those whose bootstrap started."""
        return [rank for rank in range(self.config.world_size) if self.folder.read_identity(rank) is not None]

    def ask_what_is_unfinished(self) -> None:
        """The run has been silent a while: ask its ranks, quietly, what they have not finished (`hang.PEEK`;
        each answers with a file the waiting line reads, `RunFolder.take_peek_answers`)."""
        hang.ask(self.folder, self.ranks_to_ask(), hang.PEEK)

    def on_timeout(self, output: OutputPump, why: str = "timed out") -> None:
        """The deadline passed (`why` "timed out"), or stop was pressed ("stopped"), and the run still goes on:
        gather what the hang report needs before the run is stopped. Every engine gets the report this way: its
        ranks' probe threads answer through the run folder (`hang.ask`) with what each waits in and its stacks,
        while `output` is polled so that the ranks' last lines still show. An engine may add to it (the local
        one signals a rank whose thread did not answer)."""
        said = f"no result after {self.config.timeout_s:g} s" if why == "timed out" else "stopped"
        print(f"[ddp_helpers] {said}: asking every {self.ranks_asked} for its stack, then {self.stopping}.",
              file=sys.stderr, flush=True)
        hang.wait_for_answers(self.folder, hang.ask(self.folder, self.ranks_to_ask()), output.poll, self.answer_wait_s)

    #: what `stop` will do, and which ranks `ranks_to_ask` gives, as the timeout's message says them
    stopping: str = "stopping the run"
    ranks_asked: str = "rank that started"
    #: how long the hang report waits for the ranks' answers (a rank that reads its requests from a file looks
    #: every PREPARE_POLL_S, and a shared file system is slower)
    answer_wait_s: float = hang.ANSWER_WAIT_S + 1

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop whatever of the run still lives, within a bound; nothing of the run survives it. Called once,
        after a normal end too. Pressing stop again meanwhile must not cut it short: an interrupt is raised
        again at the end."""

    @abc.abstractmethod
    def ending(self) -> Ending:
        """After `stop`: how the run ended."""


class Job(abc.ABC):
    """Where and how a launch runs: `make_launch_config(script, job=SomeJob(...))`, or a `%%torchrun` cell
    with the job's options. Register a job class with `register_job` for the magic to offer its options."""

    #: who the job's runs are, in messages: "runs on this machine"
    label: ClassVar[str] = ""
    #: a cell that asks for no other job is this job's (one job is: the local one)
    is_default: ClassVar[bool] = False

    @classmethod
    def add_arguments(cls, options) -> None:
        """Declare the job's `%%torchrun` options on `options` (an argparse argument group: `add_argument`)."""

    @classmethod
    def from_arguments(cls, args) -> Job | None:
        """The job a `%%torchrun` line asks for (`args`: the parsed options), or None when it asks for
        another. The magic refuses options of the jobs it did not pick."""
        return None

    @abc.abstractmethod
    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        """Validate the job's own options against `request` and return `request.config(self_as_checked,
        ...)` (raise LaunchError, naming the fix, otherwise)."""

    @abc.abstractmethod
    def engine(self, config: LaunchConfig, folder: RunFolder) -> Engine:
        """The engine that runs `config` into `folder`."""


_REGISTERED: list[type[Job]] = []


def register_job(job: type[Job]) -> type[Job]:
    """Offer `job`'s options in `%%torchrun` (a class decorator; registering twice is harmless)."""
    if not (isinstance(job, type) and issubclass(job, Job)):
        raise TypeError(f"register_job takes a Job subclass, got {job!r}")
    if job not in _REGISTERED:
        _REGISTERED.append(job)
    return job


def registered_jobs() -> list[type[Job]]:
    """Every registered job: this package's engines first (each module registers its job as it loads)."""
    for module in pkgutil.iter_modules(__path__):
        if re.fullmatch(r"[a-z][a-z0-9_]*", module.name):
            importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_REGISTERED, key=lambda job: (not job.is_default, not job.__module__.startswith(__name__)))


def job_named(name: str) -> type[Job] | None:
    """The registered job class called `name` (`ddp_helpers.SlurmJob`), or None."""
    return next((job for job in registered_jobs() if job.__name__ == name), None)
