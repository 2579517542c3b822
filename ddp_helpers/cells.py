"""Turning a notebook cell into a script file that every rank runs.

Scripts go to `<runs root>/<notebook name>/<cell name>.py`, with a header saying where they came
from; each run's output goes beside it, in `<runs root>/<notebook name>/<cell name>/`.
The runs root is $DDP_HELPERS_RUNS if set, else `runs/` in the project (or in the current folder
when ddp_helpers is installed elsewhere).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .config import LaunchError
from .run_files import write_atomically

_VALID_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


def runs_root() -> Path:
    if os.environ.get("DDP_HELPERS_RUNS"):
        return Path(os.environ["DDP_HELPERS_RUNS"]).resolve()
    project = Path(__file__).resolve().parent.parent
    if (project / "pyproject.toml").is_file():
        return project / "runs"
    return Path.cwd() / "runs"


def notebook_name(user_namespace: dict) -> str:
    """The running notebook's file name without '.ipynb', as Jupyter tells the kernel; 'notebook' if unknown."""
    session = user_namespace.get("__session__") or os.environ.get("JPY_SESSION_NAME") or ""
    stem = Path(str(session)).stem
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem) or "notebook"


def check_cell_name(name: str) -> str:
    if not _VALID_NAME.match(name):
        raise LaunchError(f"--name must be letters, digits, '_' or '-' (it names the script file), got {name!r}.")
    return name


def write_cell_script(source: str, *, notebook: str, name: str, root: Path | None = None) -> Path:
    """Compile `source` (so a SyntaxError surfaces before anything is written or launched), then write it
    as `<root>/<notebook>/<name>.py` and return that path."""
    check_cell_name(name)
    compile(source, f"<cell {name}>", "exec")
    path = (root or runs_root()) / notebook / f"{name}.py"
    header = (
        f"# Generated from {notebook}.ipynb, %%torchrun cell {name!r} - edit the notebook, not this file.\n"
        "# Run it yourself: torchrun --nproc-per-node 2 {0}\n".format(path.name)
    )
    write_atomically(path, (header + source).encode())
    return path
