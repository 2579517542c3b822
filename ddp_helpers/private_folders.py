"""The folders a launch writes into are the learner's alone, on a shared machine too.

A cell's script and its run folder live under the runs root ($DDP_HELPERS_RUNS, often on shared scratch).
Whoever can write into a folder on that path can rename a script of their own into place before the ranks
read it. So, as OpenSSH's StrictModes does for `~/.ssh`, before a launch uses a folder:
- every folder above the runs root (or above a run folder given outside it) must belong to the learner or
  to root, and may be writable by others only with the sticky bit (as /tmp is): nobody else can then
  rename or remove what the learner made in it;
- the runs root and everything under it must belong to the learner, be writable by nobody else, and be a
  real folder, not a symbolic link (one placed there by someone else would send the learner's files to a
  place of their choosing);
- every folder the launcher makes is created 0700, whatever the umask (`run_folder.make_private_dirs`).
A folder that breaks a rule is refused with a `LaunchError` that says what to do; nothing is changed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import LaunchError
from .run_folder import RunFolder, make_private_dirs, runs_root

_FIX = ("Set DDP_HELPERS_RUNS to a folder of your own that only you can write, for example "
        "`export DDP_HELPERS_RUNS=$HOME/ddp-runs` before starting Jupyter, or `%env DDP_HELPERS_RUNS=...` in the "
        "notebook, before the first %%torchrun cell.")


def _owner(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _problem_above(path: Path, info: os.stat_result) -> str | None:
    """What is wrong with a folder above the private part of the path (None: nothing)."""
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        return f"{path} belongs to {_owner(info.st_uid)}, who could replace what is below it"
    if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"{path} can be written by other users (mode {stat.filemode(info.st_mode)}, no sticky bit)"
    return None


def _problem_inside(path: Path, info: os.stat_result) -> str | None:
    """What is wrong with the runs root or a folder under it (None: nothing)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)}); it is not followed here"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to {_owner(info.st_uid)}, not to you"
    if info.st_mode & 0o022:
        return f"{path} can be written by other users (mode {stat.filemode(info.st_mode)})"
    return None


def _problem(folder: Path, private_top: Path | None) -> str | None:
    """The first rule `folder` breaks, looking at its existing parts from / down (None: it keeps them all).
    Nothing of the path is private when `private_top` is None."""
    for part in [*reversed(folder.parents), folder]:
        try:
            info = os.lstat(part)
        except FileNotFoundError:
            return None
        inside = private_top is not None and (part == private_top or private_top in part.parents)
        problem = (_problem_inside if inside else _problem_above)(part, info)
        if problem is None and stat.S_ISLNK(info.st_mode):  # /home -> /data/home, above: its target's path too
            problem = _problem(Path(os.path.realpath(part)), None)
        if problem:
            return problem
    return None


def private_top(folder: Path) -> Path:
    """Where the private part of `folder`'s path begins: the runs root for a folder under it, else `folder`."""
    root = runs_root()
    return root if folder == root or root in folder.parents else folder


def check_private(folder: Path, top: Path | None = None) -> None:
    """Raise LaunchError if `folder` (absolute, not resolved; what exists of it) breaks a rule above."""
    problem = _problem(folder, top or private_top(folder))
    if problem:
        raise LaunchError(f"Refusing to write this launch's files in {folder}: {problem}. Another user could swap "
                          f"the script your ranks run. {_FIX}")


def private_folder(folder: Path, top: Path | None = None) -> Path:
    """Make sure `folder` (absolute, not resolved) is the learner's alone, creating what is missing of it
    with mode 0700, and return it. `top` is where the private part of the path begins (`private_top`).

    Raises:
        LaunchError: a rule of the module docstring is broken, or the folder cannot be created (a read-only
            install); it says which folder and what to do.
    """
    top = top or private_top(folder)
    check_private(folder, top)  # before creating anything: never create below a folder someone else controls
    try:
        make_private_dirs(folder)
    except OSError as error:
        raise LaunchError(f"Cannot create the folder {folder} for this launch ({error.strerror}): the runs "
                          f"folder must be somewhere you can write. {_FIX}") from None
    check_private(folder, top)  # what appeared meanwhile is judged too
    return folder


def claim_run_folder(path) -> RunFolder:
    """`RunFolder.claim` under this module's rules: the folders above the run folder are made private (or
    refused), and so is the run folder itself, before a launch writes anything in it."""
    import os

    top = private_top(Path(os.path.abspath(path)))
    return RunFolder.claim(path, make_parent=lambda parent: private_folder(parent, top),
                           check=lambda folder: check_private(folder, top))
