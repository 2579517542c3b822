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

import sys
import traceback

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .config import DEFAULT_TIMEOUT_S, LaunchError, make_launch_config
from .cells import notebook_name, write_cell_script
from .launcher import launch
from .result import RunFailed


class RunFailedInCell(RunFailed):
    """RunFailed, shown in the notebook as the run's summary rather than a traceback through this module."""

    def _render_traceback_(self) -> list[str]:
        return [self.run.summary(), "", f"{type(self).__name__}: {self}"]


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments()
    @argument("-h", "--help", action="store_true", help="show these options and do nothing else")
    @argument("-n", "--nproc", default=None,
              help="number of ranks (default: one per GPU, or 2 CPU processes without GPUs)")
    @argument("--backend", default=None,
              help="'nccl' (one GPU per rank, the default with GPUs) or 'gloo' (CPU processes)")
    @argument("--name", default=None,
              help="name of the script file written for this cell (default: cell<execution count>)")
    @argument("--timeout", default=None, type=float,
              help=f"seconds before the run is stopped with a stack dump of every rank (default {DEFAULT_TIMEOUT_S:.0f})")
    @argument("--out", default="last_run", help="variable that receives the RunResult (default: last_run)")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run this cell as a script on every rank under torchrun; see `%%torchrun?`."""
        try:
            args = parse_argstring(self.torchrun, line)
        except UsageError as error:
            raise UsageError(f"{error} (%%torchrun --help lists the options)") from None
        if args.help:
            print(self.torchrun.parser.format_help())
            return
        if not args.out.isidentifier():
            raise UsageError(f"--out must be a Python variable name, got {args.out!r}.")
        name = args.name or f"cell{self.shell.execution_count}"
        try:
            script = write_cell_script(cell, notebook=notebook_name(self.shell.user_ns), name=name)
            config = make_launch_config(script, nproc=args.nproc, backend=args.backend, timeout_s=args.timeout)
        except SyntaxError as error:
            sys.stderr.write("".join(traceback.format_exception_only(type(error), error)))
            raise UsageError(f"The cell has a syntax error (line {error.lineno}); nothing was launched.") from None
        except LaunchError as error:
            raise UsageError(str(error)) from None
        run = launch(config)
        self.shell.user_ns[args.out] = run
        if not run.ok:
            raise RunFailedInCell(run)
        print(run.summary().splitlines()[0] + f"  (result in `{args.out}`)")


def register(ipython) -> None:
    ipython.register_magics(TorchrunMagics)
