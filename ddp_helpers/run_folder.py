"""The run folder: the one contract between the ranks of a launch and the notebook that reads them back.

    <run folder>/
        .ddp_helpers-run             marker: ddp_helpers made this folder; holds the current launch's id
        .lock                        held (flock) by the launch in progress; a second launch is refused
        rank0.stdout, rank0.stderr   what rank 0 printed, capped (the first and last OUTPUT_KEEP_BYTES
                                     of each stream, with a line saying how much was dropped)
        rank0.pid                    {"run_id", "pid", "agent", "group_rank", "local_rank", "restart",
                                     "attempt", "world_size"}: for
                                     stack dumps on timeout, and which agent and attempt the rank is
        rank0.error.json             the exception that ended rank 0, with its time, if any
        rank0.stack                  every thread's stack, written when a timed-out run asks (SIGUSR1)
        rank0.hang.request           a named pipe: the launcher opens it when a run times out, and rank 0
                                     answers with rank0.hang.json, what it waits in (`_hang_probe`)
        flight_recorder/rank0        torch's flight-recorder dump, beside it (`torchfrtrace` reads it)
        facts/rank0/<name>.json|.pt  values recorded with `ddp_helpers.record`
        outcome.json                 how each rank ended, as the torchrun agents saw it (the supervisor writes it)
        agent1.outcome.json          the same, from each further agent (--nnodes), merged into outcome.json
        torchrun.log                 the agent's own output

Writer half (ranks; stays light, no torch import): `RunFolder.from_environment()`, `rank_file`,
`facts_dir`, `write_json`, `belongs_to_this_launch`. Reader half (the notebook): `RunFolder.claim`,
`start_launch`, `read_rank`, `read_outcome`, `release`.

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
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import LaunchError

RUN_DIR_ENV = "DDP_HELPERS_RUN_DIR"
RUN_ID_ENV = "DDP_HELPERS_RUN_ID"
AGENT_PID_ENV = "DDP_HELPERS_AGENT_PID"
# Which of the run's torchrun agents ("machines") started a rank, and the GPUs each agent may use.
AGENT_ENV = "DDP_HELPERS_AGENT"
AGENT_GPUS_ENV = "DDP_HELPERS_AGENT_GPUS"
# Elastic membership: the other agents start once rank 0 has printed this text.
JOIN_AFTER_ENV = "DDP_HELPERS_JOIN_AFTER"
# Starts the line a restarted rank prints first on stdout: where its new attempt begins.
ATTEMPT_MARK = "[ddp_helpers] ---"
MARKER_NAME = ".ddp_helpers-run"
LOCK_NAME = ".lock"
# Per rank and stream: the first and the last this many bytes are kept (and shown); the middle is dropped.
OUTPUT_KEEP_BYTES = 1 << 20


def write_atomically(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
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

    def rank_file(self, rank: int, kind: str) -> Path:
        """`kind`: stdout, stderr, pid, error.json."""
        return self.path / f"rank{rank}.{kind}"

    def fifo(self, rank: int, kind: str) -> Path:
        """The pipe a rank writes its stdout/stderr into (the supervisor caps it into `rank_file`)."""
        return self.path / "pipes" / f"rank{rank}.{kind}"

    def facts_dir(self, rank: int) -> Path:
        return self.path / "facts" / f"rank{rank}"

    def write_json(self, path: Path, value: dict) -> None:
        """Write a JSON object stamped with this launch's id (the reader ignores other launches' files)."""
        write_atomically(path, json.dumps({**value, "run_id": self.run_id}).encode())

    def belongs_to_this_launch(self) -> bool:
        """True while the folder's marker names this process's launch (and not a later one)."""
        marker = read_json(self.path / MARKER_NAME)
        return isinstance(marker, dict) and marker.get("run_id") == self.run_id

    # ---- reader half: used by the launcher ------------------------------------------------------

    @classmethod
    def claim(cls, path: str | os.PathLike) -> "RunFolder":
        """Create the folder (marked as ours) or reuse one we made, and lock it for one launch.

        Raises:
            LaunchError: the path exists but ddp_helpers did not make it (nothing is touched), or
                another launch is using the folder right now.
        """
        folder = cls(Path(path).resolve())
        target = folder.path
        if not (target / MARKER_NAME).is_file():  # ours only by our own marker: nothing else is ever emptied
            folder._create_marked(target)
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
        return folder

    @staticmethod
    def _create_marked(target: Path) -> None:
        if target.exists() or target.is_symlink():
            what = "a folder" if target.is_dir() else "a file"
            raise LaunchError(
                f"{target} is {what} that ddp_helpers did not create, so it will not be used as a run folder "
                "(each launch empties its run folder, and nothing of yours is ever deleted). Give a new folder "
                "name, or leave run_dir out to use one under the runs folder."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
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
            os.close(self._lock_fd)
            self._lock_fd = None

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

    def rank_pid(self, rank: int) -> int | None:
        found = self.read_own_json(self.rank_file(rank, "pid"))
        return found.get("pid") if found else None

    def rank_identity(self, rank: int) -> dict:
        """What the rank's latest attempt wrote about itself: agent, group_rank, local_rank, restart (torchrun's
        count), attempt (how many times the rank started in this launch), world_size."""
        return self.read_own_json(self.rank_file(rank, "pid")) or {}

    def rank_pids(self, nproc: int) -> list[int]:
        """The pids of the ranks that started (after a restart: of their latest attempt)."""
        return [pid for pid in map(self.rank_pid, range(nproc)) if pid]
