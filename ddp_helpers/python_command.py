"""How every Python process of ours is started: `python_module(module)` is what follows the interpreter on the
command line to run `module` as `python -m module` would, except that the working folder is not put first on
`sys.path`.

Why. `python -m` puts the folder it starts in ahead of everything installed, and ours often start in a folder
the learner chose (a cell's `--cwd`, a job's working folder) that other users of a shared machine may be able to
write: a `ddp_helpers/` or `torch/` planted there would run as the learner before a line of ours. Python 3.11's
`-P` leaves that folder off; 3.10 has no such flag, so the same is done by `-c` code that drops the entry before
importing anything but `sys`. The flag is not inherited (unlike `PYTHONSAFEPATH`), so what a learner's script
starts with `python helper.py` sees plain Python's path.
"""

from __future__ import annotations

import shlex
import sys

_ON_310 = ("import sys; del sys.path[0]; import runpy; "  # -c's sys.path[0] is '' (the working folder)
           "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def python_module(module: str, *, safe_path_flag: bool | None = None) -> list[str]:
    """The interpreter arguments that run `module` with the working folder off `sys.path`: `-P -m module` on
    Python 3.11 and later, `-c <code>` on 3.10 (`safe_path_flag` chooses, for tests). Arguments that follow
    reach the module as `sys.argv[1:]`, as with `-m`."""
    if safe_path_flag is None:
        safe_path_flag = sys.version_info >= (3, 11)
    return ["-P", "-m", module] if safe_path_flag else ["-c", _ON_310.format(module=module)]


def python_module_command(module: str, *arguments: str) -> list[str]:
    """This interpreter running `module` (`python_module`) with `arguments`: a whole command for Popen."""
    return [sys.executable, *python_module(module), *arguments]


def module_arguments(argv: list[str] | tuple[str, ...], module: str) -> list[str]:
    """What follows `python_module(module)` in `argv`, the module's own arguments."""
    prefix = python_module(module)
    if list(argv[:len(prefix)]) != prefix:
        raise ValueError(f"not a command for {module}: {list(argv)!r}")
    return list(argv[len(prefix):])


def python_module_shell(module: str) -> str:
    """`python_module_command(module)` as a shell command line (a job script's), each word quoted."""
    return " ".join(shlex.quote(word) for word in python_module_command(module))
