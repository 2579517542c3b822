"""The `%%torchrun` cell magic: run the cell on every rank.

    %load_ext ddp_helpers

    %%torchrun -n 2 --name hello --out hello_run
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

The cell is compiled first (a SyntaxError launches nothing), written to a script file, launched under
torchrun, and its RunResult left in the variable named by --out (default `last_run`). A run in which
a rank failed or that timed out fails the cell, naming the first failing rank and its traceback.
"""

from __future__ import annotations

import argparse
import builtins
import keyword
import re
import shlex
import sys
import time
import traceback
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .cells import cell_paths, notebook_key, notebook_path, write_cell_script
from .launch_options import DEFAULT_TIMEOUT_S, make_launch_config
from .engines import Job, option_text, registered_jobs
from .errors import LaunchError
from .launcher import launch
from .result import RunFailed
from .private_folders import claim_run_folder


class RunFailedInCell(RunFailed):
    """RunFailed, shown in the notebook as the run's summary rather than a traceback through this module."""

    def _render_traceback_(self) -> list[str]:
        return [self.run.summary()]  # its first line ends in FAILED and names the root cause; no traceback


class RunStopped(Exception):
    """The stop button (or an interrupt) ended the run: shown as one line, not a traceback through the
    launcher. It still fails the cell, so "Run All" stops there as it would."""

    def __init__(self, name: str, seconds: float):
        super().__init__(f"{name} stopped after {seconds:.1f} s by an interrupt (the stop button): every process of "
                         "the run has ended, nothing is left running.")

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show these options and do nothing else")
    @argument("-n", "--nproc", default=None,
              help="number of ranks (default: one per GPU, or 2 CPU processes without GPUs)")
    @argument("--backend", default=None,
              help="'nccl' (one GPU per rank, the default with GPUs) or 'gloo' (CPU processes)")
    @argument("--name", default=None,
              help="name of the script file written for this cell (default: after the notebook cell's id)")
    @argument("--timeout", default=None, type=float,
              help=f"seconds before the run is stopped with a stack dump of every rank (default {DEFAULT_TIMEOUT_S:.0f})")
    @argument("--cwd", default=None,
              help="the ranks' working directory, e.g. '.' for the notebook's folder (default: the cell's run "
                   "folder, emptied at each launch); modules beside the notebook import either way")
    @argument("--max-restarts", default=0, type=int,
              help="restart every rank up to this many times after one fails (torchrun's --max-restarts; default 0)")
    @argument("--env", action="append", default=[], metavar="NAME=VALUE",
              help="an environment variable for the run (repeat for several), e.g. --env TORCH_DISTRIBUTED_DEBUG=DETAIL")
    @argument("--may-fail", action="store_true",
              help="a failed run is shown (its summary and traceback) but does not stop the notebook: for "
                   "cells that demonstrate a failure; the result is in --out")
    @argument("--out", default="last_run", help="variable that receives the RunResult (default: last_run)")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run this cell as a script on every rank under torchrun; see `%%torchrun?`."""
        parser = _with_job_options(self.torchrun.parser)
        try:
            # Split as a shell would (IPython's own splitter keeps the quotes of --env WHO='the cell').
            args = parser.parse_args(shlex.split(line))
        except ValueError as error:  # unbalanced quotes
            raise UsageError(f"{error} in the %%torchrun line (%%torchrun --help lists the options)") from None
        except UsageError as error:
            raise UsageError(f"{error} (%%torchrun --help lists the options)") from None
        if args.help:
            print(parser.format_help())
            return
        _check_out(args.out, self.shell)
        name = args.name or _default_cell_name(self.shell)
        notebook = notebook_path(self.shell.user_ns)
        try:
            # One line above the body: the %%torchrun line is line 1, as JupyterLab numbers the cell's lines
            # and as the ranks' tracebacks do (write_cell_script's header line).
            compile("\n" + cell, f"<cell {name}>", "exec")
            script, run_dir = cell_paths(notebook_key(notebook), name)
            # Held from the script's writing to the end of the run: another kernel running the same cell
            # of the same notebook can neither replace the script under the ranks nor mix in its results.
            folder = claim_run_folder(run_dir)
        except SyntaxError as error:
            sys.stderr.write("".join(traceback.format_exception_only(type(error), error)))
            raise UsageError(f"The cell has a syntax error (line {error.lineno} of the cell); nothing was launched."
                             + _ipython_syntax_hint(error)) from None
        except LaunchError as error:
            raise UsageError(str(error)) from None
        with folder:
            try:
                write_cell_script(cell, script, origin=notebook.name if notebook else "notebook.ipynb", name=name)
                config = make_launch_config(
                    script, nproc=args.nproc, backend=args.backend, timeout_s=args.timeout, run_dir=run_dir,
                    cwd=args.cwd, max_restarts=args.max_restarts, extra_env=_variables(args.env), job=_job(args),
                    import_dir=Path.cwd(),  # where the kernel imports from: the notebook's folder in Jupyter
                )
            except LaunchError as error:
                raise UsageError(str(error)) from None
            if args.may_fail:
                # Said before it runs, whether or not it then fails (an exercise may pass): neutral until it ends.
                print("[ddp_helpers] --may-fail: this cell may fail (some are meant to); if it does, the failure is "
                      "shown and the notebook goes on.", flush=True)
            started = time.monotonic()
            try:
                run = launch(config, folder)
            except LaunchError as error:  # e.g. a cluster refused the job
                raise UsageError(str(error)) from None
            except KeyboardInterrupt:  # the launcher stopped the run and swept before letting this through
                raise RunStopped(script.name, time.monotonic() - started) from None
        self.shell.user_ns[args.out] = run
        if not run.ok and args.may_fail:
            print(run.summary() + f"\n(the failure was expected here: --may-fail; result in `{args.out}`)")
            return
        if not run.ok:
            raise RunFailedInCell(run)
        print(run.summary().splitlines()[0] + f"  (result in `{args.out}`)")

    @line_magic("torchrun")
    def torchrun_help(self, line: str):
        """`%torchrun --help` prints the options; code runs on every rank from a `%%torchrun` cell."""
        if _asks_for_help(line):
            print(_with_job_options(self.torchrun.parser).format_help())
            return
        raise UsageError("%torchrun (one %) only prints the options: %torchrun --help. To run code on every rank, "
                         "start a cell with %%torchrun (two %) and write the code below that line.")


def _help_alone(lines: list[str]) -> list[str]:
    """An input transformer: a cell that is only `%%torchrun ... --help` (no body, which IPython refuses
    for a cell magic) prints the help, as the line magic does."""
    if lines and lines[0].startswith("%%torchrun") and not "".join(lines[1:]).strip():
        if _asks_for_help(lines[0][len("%%torchrun"):]):
            return ["%torchrun --help\n"]
    return lines


def _asks_for_help(options: str) -> bool:
    """Whether a %torchrun line's options include -h or --help (unbalanced quotes: no)."""
    try:
        words = shlex.split(options)
    except ValueError:
        return False
    return "--help" in words or "-h" in words


def _ipython_syntax_hint(error: SyntaxError) -> str:
    """Why `%magic` or `!command` lines fail in a %%torchrun cell, and what to do instead."""
    if (error.text or "").lstrip()[:1] not in ("%", "!"):
        return ""
    return (" Line magics (%...) and shell commands (!...) are IPython's syntax: the ranks run the cell as a "
            "plain Python script. Put them in a cell of their own, or write Python (e.g. subprocess.run([...])).")


# Each registered job's %%torchrun options, as added to the magic's parser (once per job).
_JOB_OPTIONS: dict[type[Job], list[argparse.Action]] = {}


def _with_job_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The magic's parser with every registered job's own options, each job's under its heading (a job
    registered after the magic was loaded gets its options at the next cell)."""
    for job in registered_jobs():
        if job not in _JOB_OPTIONS:
            before = list(parser._actions)
            job.add_arguments(parser.add_argument_group(f"for {job.label}"))
            _JOB_OPTIONS[job] = [action for action in parser._actions if action not in before]
    return parser


def _job(args: argparse.Namespace) -> Job:
    """The job the line asks for: the one whose options chose it, else the default; an option of a job not
    chosen is an error that says whose it is."""
    jobs = registered_jobs()
    chosen = [job for job in (kind.from_arguments(args) for kind in jobs if not kind.is_default) if job is not None]
    if len(chosen) > 1:
        raise LaunchError(f"the options ask for {chosen[0].label} and for {chosen[1].label} at once: choose one.")
    job = chosen[0] if chosen else next(kind for kind in jobs if kind.is_default).from_arguments(args)
    for kind, actions in _JOB_OPTIONS.items():
        for action in actions:
            if kind is not type(job) and getattr(args, action.dest, action.default) != action.default:
                raise LaunchError(f"{action.option_strings[-1]} is for {kind.label}, not for {type(job).label}.")
    return job


def _check_out(name: str, shell) -> None:
    """UsageError unless `name` is a variable --out may set."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"--out must be a Python variable name, got {name!r}.")
    taken = _taken_by(name, shell)
    if taken:
        raise UsageError(f"--out {name!r} would replace {taken} in this kernel; choose another name, such as "
                         f"{name}_run.")


def _taken_by(name: str, shell) -> str:
    """What `name` already is that a RunResult must not replace: a builtin (`print`), or one of IPython's own names
    (`get_ipython`, `In`, `Out`, `exit`, the output history `_`, `_3`, `_i3`); "" when it is free."""
    ipython_names = {"get_ipython", "In", "Out", "exit", "quit", *getattr(shell, "user_ns_hidden", {})}
    if name in ipython_names or re.fullmatch(r"_+|_i+|_i?\d+|_[oid]h", name):  # IPython adds some to builtins
        return f"IPython's own {name}"
    if name in vars(builtins):
        return f"Python's built-in {name}"
    return ""


def _default_cell_name(shell) -> str:
    """A cell without --name: named after the notebook cell's id, which JupyterLab (and nbclient) send with
    every execution, so running the cell again reuses its script and run folder instead of adding one per
    run; else (plain IPython) after the execution count."""
    parent = shell.get_parent() if hasattr(shell, "get_parent") else None
    cell_id = str(((parent or {}).get("metadata") or {}).get("cellId") or "")
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", cell_id):
        return f"cell-{cell_id}"
    return f"cell{shell.execution_count}"


def _variables(assignments: list[str]) -> dict[str, str]:
    """--env NAME=VALUE options as a dict (make_launch_config checks the names and values)."""
    variables = {}
    for assignment in assignments:
        name, equals, value = option_text(assignment).partition("=")  # --env 'MSG=hello world' too
        if not equals:
            raise LaunchError(f"--env takes NAME=VALUE, got {assignment!r}. Example: --env TORCH_DISTRIBUTED_DEBUG=DETAIL")
        variables[name] = option_text(value)
    return variables




def register(ipython) -> None:
    ipython.register_magics(TorchrunMagics)
    if _help_alone not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(_help_alone)
