"""Where a run keeps its files. The worker side (bootstrap, `record`) writes them, the launcher reads them.

    <run_dir>/
        rank0.stdout, rank0.stderr   everything rank 0 printed (file descriptors 1 and 2)
        rank0.pid                    its process id, for stack dumps on timeout
        rank0.exit.json              {"exit_code": 0, ...}, written as the rank ends normally or by an exception
        rank0.error.json             the exception that ended rank 0, with its time, if any
        facts/rank0/<name>.json|.pt  values recorded with `ddp_helpers.record`
        torchrun.log                 the torchrun agent's own output
        torchelastic/                torchrun's log folder (removed after the run)

Environment variables set by the launcher for every rank:
    DDP_HELPERS_RUN_DIR   the run directory above
    DDP_HELPERS_RUN_ID    a marker unique to the run, used to find and stop every process of it
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RUN_DIR_ENV = "DDP_HELPERS_RUN_DIR"
RUN_ID_ENV = "DDP_HELPERS_RUN_ID"


def rank_file(run_dir: str | os.PathLike, rank: int, kind: str) -> Path:
    """`kind` is one of stdout, stderr, pid, exit.json, error.json."""
    return Path(run_dir) / f"rank{rank}.{kind}"


def facts_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "facts" / f"rank{rank}"


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


def write_json(path: Path, value: object) -> None:
    write_atomically(path, json.dumps(value).encode())


def read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
