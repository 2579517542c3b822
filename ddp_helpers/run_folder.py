"""The run folder: the one contract between the ranks of a launch and the notebook that reads them back.

    <run folder>/
        .ddp_helpers-run             marker: ddp_helpers made this folder; holds the current launch's id
        .lock                        held (flock) by the launch in progress; a second launch is refused
        .forked                      "pid start-time" of every child a rank's Python forked (the sweep's list)
        rank0.stdout, rank0.stderr   what rank 0 printed, capped (the first and last OUTPUT_KEEP_BYTES
                                     of each stream, with a line saying how much was dropped)
        rank0.identity.json          who rank 0's latest attempt is (`RankIdentity`: pid, agent, group and
                                     local rank, restart, attempt, world size, node)
        rank0.error.json             the exception that ended rank 0, with its time, if any (`RankErrorRecord`)
        rank0.exit.json              how rank 0's script ended (its exit code), for launches without an agent to ask
        rank0.<kind>                 a client's records of rank 0, kept by its rank hook (`rank_record`; the
                                     course's: `ddp_helpers/course/records.py`)
        rank0.stack                  every thread's stack, written when a timed-out run asks (SIGUSR1)
        rank0.hang.request           a named pipe: the launcher opens it when a run times out, and rank 0
                                     answers with rank0.hang.json, what it waits in (`_hang_probe`);
        rank0.peek.json              what rank 0 has not finished, asked while the run is silent (the waiting
                                     line), removed as the launcher reads it
        flight_recorder/rank0        torch's flight-recorder dump, beside it (`torchfrtrace` reads it)
        facts/rank0/<name>.json|.pt  values recorded with `ddp_helpers.record`
        pipes/rank0.stdout           the pipes a rank writes its output into while the supervisor runs
        supervisor.json              what the launcher asks of the supervisor (`supervisor_spec.SupervisorSpec`)
        outcome.json                 how each rank ended, as the torchrun agents saw it (the supervisor writes it)
        agent1.outcome.json          the same, from each further agent (--nnodes), merged into outcome.json
        torchrun.log                 the agent's own output; torchelastic/: torchrun's --log-dir, while it runs
        job-<job id>.out             a scheduler's job's own output (`job_log`)

No other module spells these names: each file has its methods here.
- Paths: `output(rank, stream)`, `fifo(rank, stream)` in `pipes_dir`, `stack_file(rank)`, `hang_request(rank)`,
  `flight_recorder_dump(rank)`, `facts_dir(rank)`, `torchrun_log`, `torchrun_log_dir`, `supervisor_spec`,
  `job_log(job_id)`; `is_bookkeeping(path)` tells a rank's own files from the folder's; `rank_file_owner(path)`
  names the rank whose file a path is.
- Written by the ranks (light: no torch import): `from_environment()`, `write_identity(RankIdentity)`,
  `write_error(RankErrorRecord)`, `clear_error(rank)`, `write_exit(rank, code)`,
  `write_hang_answer(rank, answer)`, `write_peek_answer(rank, answer)`, `belongs_to_this_launch()`; a client's
  own records: `rank_record(rank, kind)` for a kind `register_rank_records` registered, `write_json`,
  `append_line`.
- Written by the supervisor: `write_outcome(outcome, agent=None)`.
- Read by the launcher: `claim(path)`, `start_launch(run_id)`, `release()`, `read_identity(rank)`,
  `rank_pid(rank)`, `rank_pids(world_size)`, `read_error(rank)`, `read_exit_code(rank)`,
  `read_hang_answer(rank)`, `take_peek_answers(world_size)`, `read_outcome(agent=None)`, `read_text(path)`,
  `read_own_json(path)`.

Safety rules:
- Only a folder that carries the marker is ever emptied; an existing folder without it is refused
  (`LaunchError`), so nothing of the user's is deleted.
- One launch at a time per folder (an exclusive lock held for the whole launch).
- Every JSON file a rank writes carries the launch's id; the reader ignores files of another launch.

Environment variables set by the launcher for every rank:
    DDP_HELPERS_RUN_DIR   the run folder
    DDP_HELPERS_RUN_ID    a marker unique to the launch, used to tie files to it and to find its processes
    DDP_HELPERS_AGENT_PID the torchrun agent's pid: a rank whose parent is already gone exits at once
    DDP_HELPERS_AGENT     which of the run's agents started the rank (0 .. nnodes - 1)
    DDP_HELPERS_NODE      the name of the machine it runs on, where the host's own name would not say
    DDP_HELPERS_LOOPBACK_ONLY "1" when every rank is on this machine: stores listen on loopback only
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable


RUN_DIR_ENV = "DDP_HELPERS_RUN_DIR"
# A folder each rank puts on sys.path after its script's own: a cell's notebook folder, so that a module
# beside the notebook imports in the cell's ranks as it does in the kernel.
IMPORT_DIR_ENV = "DDP_HELPERS_IMPORT_DIR"
RUN_ID_ENV = "DDP_HELPERS_RUN_ID"
AGENT_PID_ENV = "DDP_HELPERS_AGENT_PID"
# Which of the run's torchrun agents ("machines") started a rank, and the machine's name (default: the host's).
AGENT_ENV = "DDP_HELPERS_AGENT"
NODE_ENV = "DDP_HELPERS_NODE"
# "1": every rank of the run is on this machine, and the stores it opens must listen on loopback only.
LOOPBACK_ENV = "DDP_HELPERS_LOOPBACK_ONLY"
# One rank's files: rankN.<kind> here and in pipes/, flight_recorder/rankN, facts/rankN/ (`rank_file_owner`); a
# client's rank hook adds the kinds of its own records (`register_rank_records`).
_RANK_KINDS = ["stdout", "stderr", "identity.json", "error.json", "exit.json", "stack", "hang.request", "hang.json",
               "peek.json"]


def _rank_file_pattern() -> re.Pattern:
    return re.compile(r"rank(\d+)(?:\.(" + "|".join(map(re.escape, _RANK_KINDS)) + "))?")


_RANK_FILE = _rank_file_pattern()


def register_rank_records(*kinds: str) -> None:
    """Files `rankN.<kind>` that a client's rank hook keeps in the run folder (`RunFolder.rank_record`): each
    rank's own, like the launcher's, for `rank_file_owner` and `is_bookkeeping`. Call it as the hook's module loads,
    in the ranks and where they are read back."""
    global _RANK_FILE
    for kind in kinds:
        if not re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z]+)?", kind):
            raise ValueError(f"{kind!r} is not a rank record's kind: lower-case letters, digits and '_', one optional suffix")
        if kind not in _RANK_KINDS:
            _RANK_KINDS.append(kind)
    _RANK_FILE = _rank_file_pattern()
_TEMPORARY = re.compile(r"\.(.+)\.\w+\.tmp")  # write_atomically's, for the file it will replace
_AGENT_OUTCOME = re.compile(r"agent\d+\.outcome\.json")
# A number only this rank's process is handed, in its environment, by a client's rank hook (the course's: its
# exercises' data; `ddp_helpers.rank_secret` reads it).
SECRET_ENV = "DDP_HELPERS_RANK_SECRET"
# Starts the line a restarted rank prints first on stdout: where its new attempt begins.
ATTEMPT_MARK = "[ddp_helpers] ---"
MARKER_NAME = ".ddp_helpers-run"
LOCK_NAME = ".lock"
# Per rank and stream: the first and the last this many bytes are kept (and shown); the middle is dropped.
OUTPUT_KEEP_BYTES = 1 << 20


def runs_root() -> Path:
    """Where generated scripts and run folders go: $DDP_HELPERS_RUNS if set; else `runs/` in the project (or in
    the current folder when ddp_helpers is installed elsewhere) when that is the user's own to make or use;
    else, as on a shared install the user cannot write (a workshop's course, an administrator's environment),
    a folder in the user's own cache, `${XDG_CACHE_HOME:-~/.cache}/ddp-helpers/runs`, said once per process.
    With none of those (no home of the user's own), the project's: the launch then refuses it and says to set
    $DDP_HELPERS_RUNS (`private_folders`)."""
    if os.environ.get("DDP_HELPERS_RUNS"):
        # Not resolved: a symbolic link placed there is refused by the launch (`private_folders`), not followed.
        return Path(os.path.abspath(Path(os.environ["DDP_HELPERS_RUNS"]).expanduser()))
    project = Path(__file__).resolve().parent.parent
    beside = project / "runs" if (project / "pyproject.toml").is_file() else Path.cwd() / "runs"
    if _the_users_own(beside) or (not os.path.lexists(beside) and _the_users_own(beside.parent)):
        return beside
    cache = _users_cache()
    if cache is None:
        return beside
    root = cache / "ddp-helpers" / "runs"
    global _said_where
    if not _said_where:
        _said_where = True
        print(f"[ddp_helpers] runs go to {root}: {beside} is not yours to write (set DDP_HELPERS_RUNS to choose)",
              file=sys.stderr, flush=True)
    return root


_said_where = False


def _the_users_own(path: Path) -> bool:
    """Whether `path` is a real folder (not a link) that belongs to the user running this."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def _users_cache() -> Path | None:
    """$XDG_CACHE_HOME if it is the user's own, else ~/.cache in a home of the user's own; None without either."""
    configured = os.environ.get("XDG_CACHE_HOME")
    if configured and os.path.isabs(configured) and _the_users_own(Path(configured)):
        return Path(configured)
    home = Path(os.path.expanduser("~"))
    if home.is_absolute() and _the_users_own(home):
        return home / ".cache"
    return None


def demo_jobs_root() -> Path:
    """Where lesson 4's own cluster jobs (not a cell's) keep their files: under the runs root, which every node sees."""
    return runs_root() / "cluster-demos"


def default_run_dir(script: Path) -> Path:
    """A run folder of its own for each script path: two scripts with one name never share one."""
    digest = hashlib.sha1(str(script).encode()).hexdigest()[:8]
    return runs_root() / "scripts" / f"{script.stem}-{digest}"


@dataclass(frozen=True)
class RankIdentity:
    """What a rank's latest attempt wrote about itself as it started (`rankN.pid`)."""

    rank: int
    pid: int
    agent: int = 0  # which of the run's torchrun agents started it
    group_rank: int = 0
    local_rank: int = 0
    restart: int = 0  # torchrun's restart count (TORCHELASTIC_RESTART_COUNT)
    attempt: int = 1  # how many times the rank has started in this launch
    world_size: int = 1
    node: str | None = None


@dataclass(frozen=True)
class AgentOutcome:
    """How torchrun's agents saw a run end (`outcome.json`, the supervisor's merged view; each further
    agent writes its own, `agentK.outcome.json`).

    Args:
        succeeded (bool): every rank finished well.
        failures (dict[int, int] | None): each failed rank's exit code as its agent saw it (negative: the
            signal that killed it); None when no agent could say (stopped, or broken, before its torchrun
            returned).
        unfinished_agents (tuple[int, ...]): agents stopped before they could say how their ranks ended:
            those ranks are among neither the failures nor the finished.
        died_at (dict[int, float]): when the supervisor saw each rank dead (time.time()).
        stopped_by (str): the signal or the reason that stopped the agents, if they were stopped.
        agent_error (str): an agent's own failure, if one broke.
    """

    succeeded: bool
    failures: dict[int, int] | None = None
    unfinished_agents: tuple[int, ...] = ()
    died_at: dict[int, float] = field(default_factory=dict)
    stopped_by: str = ""
    agent_error: str = ""

    @classmethod
    def from_json(cls, value: dict | None) -> AgentOutcome | None:
        outcome = _from_json(cls, value)
        if outcome is None:
            return None
        try:  # JSON keys are strings
            failures = None if outcome.failures is None else {int(r): int(c) for r, c in outcome.failures.items()}
            return replace(outcome, failures=failures, unfinished_agents=tuple(map(int, outcome.unfinished_agents)),
                           died_at={int(r): float(t) for r, t in outcome.died_at.items()},
                           succeeded=outcome.succeeded is True)
        except (AttributeError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class KillRequest:
    """Which rank kills itself once it has printed which line (`.kill_request.json`, from --kill-rank and
    --kill-after)."""

    rank: int
    text: str


@dataclass(frozen=True)
class RankErrorRecord:
    """The exception that ended a rank (`rankN.error.json`)."""

    rank: int
    time: float
    type: str
    message: str
    traceback: str


def _from_json(cls, value: dict | None):
    """A dataclass from the JSON object a launch wrote, or None (missing, or not of this shape)."""
    if value is None:
        return None
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{key: item for key, item in value.items() if key in names})
    except TypeError:
        return None


def make_private_dirs(folder: Path) -> None:
    """`folder` and any missing folder above it, each created with mode 0700 whatever the umask (under
    umask 002 a plain mkdir lets the group replace what is inside)."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for part in reversed(missing):
        try:
            part.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile (another launch): the caller's checks judge it
        part.chmod(0o700)  # mkdir's mode is masked by the umask (0o777 would leave 0o000): set it exactly


_OPEN_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def open_private(path: str | os.PathLike, mode: str = "w"):
    """`open(path, mode)` ("w", "a", "wb", "ab") for a file created readable and writable by its owner only,
    whatever the umask (a file that exists keeps its mode)."""
    return open(os.open(path, _OPEN_FLAGS[mode[0]] | os.O_CLOEXEC, 0o600), mode)


def append_line(path: Path, line: str) -> None:
    """Append `line` to a private file in one write (appends from several processes, a rank and its forks, never
    interleave), at once: a process that then ends with os._exit keeps it. Silent if the file cannot be opened."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RunFolder:
    """A run folder (see the module docstring). `path` is absolute."""

    def __init__(self, path: str | os.PathLike, run_id: str | None = None):
        self.path = Path(path)
        self.run_id = run_id
        self._lock_fd: int | None = None

    # ---- writer half: used inside the ranks ------------------------------------------------------

    @classmethod
    def from_environment(cls) -> "RunFolder | None":
        """The folder of the launch this process belongs to, or None outside a launch."""
        path = os.environ.get(RUN_DIR_ENV)
        return cls(path, os.environ.get(RUN_ID_ENV)) if path else None

    # ---- where each file is: the only place its name is spelled -----------------------------------

    def _rank_file(self, rank: int, kind: str) -> Path:
        return self.path / f"rank{rank}.{kind}"

    def output(self, rank: int, stream: str) -> Path:
        """What the rank printed on `stream` ("stdout" or "stderr"), capped by the supervisor."""
        return self._rank_file(rank, stream)

    def identity_file(self, rank: int) -> Path:
        """Written by the rank's bootstrap as its attempt starts (`write_identity`)."""
        return self._rank_file(rank, "identity.json")

    def exit_file(self, rank: int) -> Path:
        """Written by the rank's bootstrap last, as it ends (`write_exit`)."""
        return self._rank_file(rank, "exit.json")

    @property
    def outcome_file(self) -> Path:
        """Written by the supervisor once the run is over and swept (`write_outcome`)."""
        return self._outcome_file(None)

    def fifo(self, rank: int, stream: str) -> Path:
        """The pipe a rank writes its stdout/stderr into (the supervisor caps it into `output`)."""
        return self.pipes_dir / f"rank{rank}.{stream}"

    @property
    def pipes_dir(self) -> Path:
        """The supervisor's folder of output pipes, there while it runs."""
        return self.path / "pipes"

    def stack_file(self, rank: int) -> Path:
        """Where faulthandler writes every thread's stack when the launcher sends SIGUSR1."""
        return self._rank_file(rank, "stack")

    def hang_request(self, rank: int) -> Path:
        """The named pipe the launcher writes into to ask a timed-out rank what it waits in."""
        return self._rank_file(rank, "hang.request")

    def flight_recorder_dump(self, rank: int) -> Path:
        """torch's raw flight-recorder dump of a timed-out rank, where `torchfrtrace` reads it."""
        return self.path / "flight_recorder" / f"rank{rank}"

    def facts_dir(self, rank: int) -> Path:
        return self.path / "facts" / f"rank{rank}"

    @property
    def torchrun_log(self) -> Path:
        return self.path / "torchrun.log"

    @property
    def torchrun_log_dir(self) -> Path:
        """torchrun's --log-dir, removed when the run ends."""
        return self.path / "torchelastic"

    @property
    def kill_request(self) -> Path:
        """Which rank kills itself once it has printed which text (`kill_rank`, `kill_after`); hidden, so
        bookkeeping."""
        return self.path / ".kill_request.json"

    @property
    def forked_children(self) -> Path:
        """Every process a rank's Python forks, as "pid start-time" lines (`record_forked_child`); hidden."""
        return self.path / ".forked"

    @property
    def supervisor_spec(self) -> Path:
        """The `SupervisorSpec` the local engine hands its supervisor."""
        return self.path / "supervisor.json"

    def job_log(self, job_id: str = "%j") -> Path:
        """A scheduler's job's own output (its --output option; %j: the job id, as the scheduler writes it)."""
        return self.path / f"job-{job_id}.out"

    def is_bookkeeping(self, path: str) -> bool:
        """True for the folder's own files, by their exact names (the ranks' outputs and records, facts, dumps,
        the agents' outcomes, the launch's hidden files, and write_atomically's temporary files of them): not
        files a rank's script wrote, whatever it names them."""
        folder, name = os.path.split(path)
        temporary = _TEMPORARY.fullmatch(name)
        if temporary is not None:
            name, path = temporary.group(1), os.path.join(folder, temporary.group(1))
        if folder == str(self.path) and (
                name in (MARKER_NAME, LOCK_NAME, ".kill_request.json", ".forked", "outcome.json", "torchrun.log",
                         "supervisor.json") or _AGENT_OUTCOME.fullmatch(name)):
            return True
        return self.rank_file_owner(path) is not None

    # ---- written by the ranks ---------------------------------------------------------------------

    def write_json(self, path: Path, value: dict) -> None:
        """Write a JSON object stamped with this launch's id (the reader ignores other launches' files)."""
        write_atomically(path, json.dumps({**value, "run_id": self.run_id}).encode())

    def rank_record(self, rank: int, kind: str) -> Path:
        """A client's record of one rank, `rankN.<kind>` (a kind `register_rank_records` registered)."""
        if kind not in _RANK_KINDS:
            raise ValueError(f"rank record {kind!r} is not registered: register_rank_records({kind!r}) first")
        return self._rank_file(rank, kind)

    def rank_file_owner(self, path) -> tuple[int, str] | None:
        """(rank, its name in this folder) when `path` is one rank's file here (its secret, output, records,
        facts, flight-recorder dump, pipes), reached by any route (links and ".." resolved); else None. A bare
        relative `rankN.<kind>` counts when this folder has it (it may be opened relative to a folder
        descriptor). Cheap for other paths: a rank's audit hook asks this of every file its script opens."""
        path = os.fsdecode(path)
        if "rank" not in path:
            return None
        real = os.path.join(os.path.realpath(os.path.dirname(os.path.join(os.getcwd(), path))), os.path.basename(path))
        parts = os.path.relpath(real, self._real_path()).split(os.sep)
        if parts[0] == os.pardir and not os.path.isabs(path) and os.sep not in path and (self.path / path).exists():
            parts = [path]
        first = _RANK_FILE.fullmatch(parts[0])
        if len(parts) == 1 and first is not None and first.group(2) is not None:
            return int(first.group(1)), parts[0]
        second = _RANK_FILE.fullmatch(parts[1]) if len(parts) > 1 else None
        if second is None:
            return None
        if (parts[0] == "facts" and second.group(2) is None or parts[0] == "flight_recorder" and len(parts) == 2
                and second.group(2) is None or parts[0] == "pipes" and len(parts) == 2
                and second.group(2) in ("stdout", "stderr")):
            return int(second.group(1)), os.path.join(*parts)
        return None

    def _real_path(self) -> str:
        if getattr(self, "_real", None) is None:
            self._real = os.path.realpath(self.path)
        return self._real

    def write_identity(self, identity: RankIdentity) -> None:
        self.write_json(self._rank_file(identity.rank, "identity.json"), asdict(identity))

    def write_error(self, error: RankErrorRecord) -> None:
        self.write_json(self._rank_file(error.rank, "error.json"), asdict(error))

    def clear_error(self, rank: int) -> None:
        """An earlier attempt's error, removed as a restarted rank starts."""
        self._rank_file(rank, "error.json").unlink(missing_ok=True)

    def write_exit(self, rank: int, exit_code: int) -> None:
        self.write_json(self._rank_file(rank, "exit.json"), {"rank": rank, "exit_code": exit_code})

    def record_forked_child(self, pid: int, started: int | None) -> None:
        """Called in each child a rank's Python forks, as it starts: the final sweep finds it here whatever it
        then does (a new session, another name; a warm rank's /proc environ carries no marker)."""
        append_line(self.forked_children, f"{pid} {started}")

    def read_forked_children(self) -> list[tuple[int, int]]:
        pairs = []
        for line in self.read_text(self.forked_children).splitlines():
            pid, _, started = line.partition(" ")
            if pid.isdigit() and started.isdigit():
                pairs.append((int(pid), int(started)))
        return pairs

    def write_hang_answer(self, rank: int, answer: dict) -> None:
        self.write_json(self._rank_file(rank, "hang.json"), {"rank": rank, **answer})

    def write_peek_answer(self, rank: int, answer: dict) -> None:
        """The waiting line's answer (`_hang_probe._unfinished`): what the rank has not finished."""
        self.write_json(self._rank_file(rank, "peek.json"), answer)

    def take_peek_answers(self, world_size: int) -> dict[int, dict]:
        """The waiting line's answers that came in since the last take, removed as read: the next ones are fresh."""
        answers = {}
        for rank in range(world_size):
            answer = self.read_own_json(self._rank_file(rank, "peek.json"))
            if answer is not None:
                answers[rank] = answer
                self._rank_file(rank, "peek.json").unlink(missing_ok=True)
        return answers

    def remove_empty_stack_files(self, world_size: int) -> None:
        for rank in range(world_size):
            stack = self.stack_file(rank)
            if stack.is_file() and stack.stat().st_size == 0:
                stack.unlink()

    def write_outcome(self, outcome: AgentOutcome, agent: int | None = None) -> None:
        """How the ranks ended as a torchrun agent saw them: the run's (agent None, the supervisor's
        merged view) or one further agent's."""
        self.write_json(self._outcome_file(agent), asdict(outcome))

    def _outcome_file(self, agent: int | None) -> Path:
        return self.path / ("outcome.json" if agent is None else f"agent{agent}.outcome.json")

    def belongs_to_this_launch(self) -> bool:
        """True while the folder's marker names this process's launch (and not a later one)."""
        marker = read_json(self.path / MARKER_NAME)
        return isinstance(marker, dict) and marker.get("run_id") == self.run_id

    # ---- reader half: used by the launcher ------------------------------------------------------

    @classmethod
    def claim(cls, path: str | os.PathLike, make_parent: Callable[[Path], object],
              check: Callable[[Path], None]) -> "RunFolder":
        """Create the folder (marked as ours) or reuse one we made, and lock it for one launch. `make_parent`
        makes (and vets) the folder above it, `check` vets the folder itself: the policy of who may own them is
        `private_folders.claim_run_folder`'s, which every launch calls.

        Raises:
            LaunchError: the path exists but ddp_helpers did not make it (nothing is touched), or
                another launch is using the folder right now.
        """
        from .errors import LaunchError  # here: the zygote stub loads this module outside the package

        # Not resolved: a symbolic link where the runs root should be is refused, not followed.
        folder = cls(Path(os.path.abspath(path)))
        target = folder.path
        make_parent(target.parent)
        if not (target / MARKER_NAME).is_file():  # ours only by our own marker: nothing else is ever emptied
            folder._create_marked(target)
        check(target)  # a marked folder someone else made is refused too
        lock_fd = os.open(target / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            holder = read_json(target / MARKER_NAME) or {}
            raise LaunchError(
                f"The run folder {target} is in use by another launch right now (process {holder.get('pid', '?')}): "
                "two launches sharing one folder would read each other's results. Wait for it to finish, or "
                "give this one another name (magic: --name, launch: run_dir=)."
            ) from None
        folder._lock_fd = lock_fd
        folder._claimed_inode = os.fstat(lock_fd).st_dev, os.lstat(target).st_ino
        return folder

    @staticmethod
    def _create_marked(target: Path) -> None:
        from .errors import LaunchError

        if target.exists() or target.is_symlink():
            what = "a folder" if target.is_dir() else "a file"
            raise LaunchError(
                f"{target} is {what} that ddp_helpers did not create (it has no {MARKER_NAME} file), so it will not "
                "be used as a run folder (each launch empties its run folder, and nothing of yours is ever deleted). "
                "Give a new folder name, or leave run_dir out to use one under the runs folder. If it is a run "
                "folder of yours whose marker was removed while no launch held it, delete the folder yourself "
                "and launch again."
            )
        # Made complete (with its marker) under a temporary name, then renamed: a concurrent claimer sees
        # either no folder or a marked one, never a bare one it would have to refuse.
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".new"))
        try:
            write_atomically(staging / MARKER_NAME, json.dumps({"run_id": None, "pid": os.getpid()}).encode())
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / MARKER_NAME).is_file():
                raise LaunchError(f"Could not create the run folder {target}: it appeared meanwhile without the "
                                  "ddp_helpers marker. Choose another run folder.") from None

    def start_launch(self, run_id: str) -> None:
        """Empty the (locked, marked) folder of an earlier launch's files and stamp it with `run_id`."""
        if self._lock_fd is None:
            raise RuntimeError("claim() the run folder before starting a launch in it")
        self.run_id = run_id
        for entry in self.path.iterdir():
            if entry.name in (MARKER_NAME, LOCK_NAME):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        write_atomically(self.path / MARKER_NAME, json.dumps({"run_id": run_id, "pid": os.getpid()}).encode())

    def release(self) -> None:
        if self._lock_fd is not None:
            self._restore_marker()
            os.close(self._lock_fd)
            self._lock_fd = None

    def _restore_marker(self) -> None:
        """Put the marker back if the launch's script removed it (a script that empties its working folder, which
        is this folder by default): without it the folder would never be claimed again. Only into the very folder
        claimed (same inode, not a link put in its place), so a marker never lands in a folder of the learner's."""
        marker = self.path / MARKER_NAME
        try:
            if marker.is_file() or (os.fstat(self._lock_fd).st_dev, os.lstat(self.path).st_ino) != self._claimed_inode:
                return
            write_atomically(marker, json.dumps({"run_id": self.run_id, "pid": os.getpid()}).encode())
        except OSError:
            pass  # the folder itself is gone: the next launch makes a new one

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def read_own_json(self, path: Path) -> dict | None:
        """A JSON file written by this launch, or None (missing, unreadable, or another launch's)."""
        value = read_json(path)
        return value if isinstance(value, dict) and value.get("run_id") == self.run_id else None

    def read_text(self, path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def write_kill_request(self, request: KillRequest) -> None:
        self.write_json(self.kill_request, asdict(request))

    def read_kill_request(self) -> KillRequest | None:
        return _from_json(KillRequest, self.read_own_json(self.kill_request))

    def read_identity(self, rank: int) -> RankIdentity | None:
        """What the rank's latest attempt wrote about itself, or None if it never started."""
        return _from_json(RankIdentity, self.read_own_json(self._rank_file(rank, "identity.json")))

    def rank_pid(self, rank: int) -> int | None:
        identity = self.read_identity(rank)
        return identity.pid if identity else None

    def rank_pids(self, world_size: int) -> list[int]:
        """The pids of the ranks that started (after a restart: of their latest attempt)."""
        return [pid for pid in map(self.rank_pid, range(world_size)) if pid]

    def read_error(self, rank: int) -> RankErrorRecord | None:
        return _from_json(RankErrorRecord, self.read_own_json(self._rank_file(rank, "error.json")))

    def read_exit_code(self, rank: int) -> int | None:
        """The exit code the rank wrote as it ended; None if it did not end normally."""
        return (self.read_own_json(self._rank_file(rank, "exit.json")) or {}).get("exit_code")

    def read_hang_answer(self, rank: int) -> dict | None:
        return self.read_own_json(self._rank_file(rank, "hang.json"))

    def hang_answered(self, rank: int) -> bool:
        return self._rank_file(rank, "hang.json").exists()

    def read_outcome(self, agent: int | None = None) -> AgentOutcome | None:
        return AgentOutcome.from_json(self.read_own_json(self._outcome_file(agent)))
