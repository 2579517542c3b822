"""Turning a notebook cell into a script file that every rank runs.

Scripts go to `<runs root>/<notebook key>/scripts/<cell name>/<cell name>.py`, with a header saying where
they came from; each run's folder is `<runs root>/<notebook key>/<cell name>/`. Each script has a folder of
its own because a script's folder is first on its ranks' `sys.path` (as with `python script.py`): in a
shared folder, a cell named `model` would be what another cell's `import model` finds. For the same
reason a cell may not be named after a module its ranks can import (`logging`, `numpy`, a `model.py`
beside the notebook): its script would be imported in the module's place, by torch too. The notebook key is the
notebook's file name for the course's own notebooks (`runs/02_ddp_basics/`), and the name plus a hash
of the notebook's full path for any other, so two notebooks with one name never share a folder.
The runs root is $DDP_HELPERS_RUNS if set, else `runs/` in the project (`run_folder.runs_root`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from .run_folder import runs_root
from .errors import LaunchError
from .private_folders import private_folder
from .run_folder import write_atomically

_VALID_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
COURSE_NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_path(user_namespace: dict) -> Path | None:
    """The running notebook's path, as Jupyter tells the kernel; None if unknown (plain IPython)."""
    session = user_namespace.get("__session__") or os.environ.get("JPY_SESSION_NAME") or ""
    return Path(str(session)).expanduser().resolve() if session else None


def notebook_key(path: Path | None) -> str:
    """The folder name under the runs root for a notebook's scripts and runs."""
    if path is None:
        return "notebook"
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem) or "notebook"
    if path.parent == COURSE_NOTEBOOKS:
        return stem
    return f"{stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


MAX_NAME_LENGTH = 100  # file names stop at 255 bytes, and the run folder adds its own below it
# Folders under <runs root>/<notebook key>/ that are not a cell's run folder.
_RESERVED = {"scripts": "holds the cells' scripts", "plots": "holds the plots launch_lesson.sh saves"}


def _shadows_a_module(name: str) -> bool:
    """Whether `import name` finds something (the standard library, an installed package, a file in the
    notebook's folder) that the cell's script `name.py` would replace on its ranks."""
    if not name.isidentifier():
        return False  # e.g. "step-1": no import statement can name it
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return True


def check_cell_name(name: str) -> str:
    if not _VALID_NAME.match(name):
        raise LaunchError(f"--name must be letters, digits, '_' or '-' (it names the script file), got {name!r}.")
    if len(name) > MAX_NAME_LENGTH:
        raise LaunchError(f"--name is at most {MAX_NAME_LENGTH} characters (it names the script file and the run "
                          f"folder), got {len(name)}.")
    if name in _RESERVED:
        raise LaunchError(f"--name {name!r} is taken: the notebook's runs folder has a {name}/ folder that "
                          f"{_RESERVED[name]}. Choose another name.")
    if _shadows_a_module(name):
        raise LaunchError(
            f"--name {name!r} would shadow the module {name!r}: the cell's script, {name}.py, comes first on its "
            f"ranks' sys.path, so `import {name}` (in the cell, or inside torch) would import the cell instead. "
            f"Choose another name, such as {name}_cell."
        )
    return name


def cell_paths(notebook: str, name: str, root: Path | None = None) -> tuple[Path, Path]:
    """(script file, run folder) of cell `name` of the notebook with key `notebook`."""
    check_cell_name(name)
    folder = (root or runs_root()) / notebook
    return folder / "scripts" / name / f"{name}.py", folder / name


CELL_SCRIPT_MARK = "%%torchrun cell"  # in the first line of every script written from a cell


def is_cell_script(script: Path) -> bool:
    """Whether `script` was written from a `%%torchrun` cell (its lines are the cell's, as JupyterLab numbers them)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as file:
            first = file.readline()
    except OSError:
        return False
    return first.startswith("# Generated from ") and CELL_SCRIPT_MARK in first


def write_cell_script(source: str, script: Path, *, origin: str, name: str) -> Path:
    """Write `source` (compiled by the caller, so that a SyntaxError creates nothing) to `script`, with a
    header saying where it came from."""
    # One line, standing where the cell's `%%torchrun` line stands: line N of the script is line N of the
    # cell as JupyterLab numbers it, in tracebacks, stack dumps and checkers' hints alike.
    header = (f"# Generated from {origin}, {CELL_SCRIPT_MARK} {name!r} - edit the notebook, not this file. "
              f"Run it yourself: torchrun --nproc-per-node 2 {script.name}\n")
    private_folder(script.parent)  # a folder another user can write in would let them swap the script
    write_atomically(script, (header + source).encode())
    return script
