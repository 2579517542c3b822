"""ddp_helpers: run notebook cells on every rank under torchrun, and read back what each rank did.

Public API (see README.md):
    make_launch_config, launch, run_script   launch a script; get a RunResult
    RunResult, RankResult, RunFailed, LaunchError
    record, RecordError                      script side: save a value for the notebook
    %load_ext ddp_helpers                    the %%torchrun cell magic

This module stays light: ranks import it to call `record`, so nothing heavy (torch, IPython,
matplotlib) is imported here.
"""

from __future__ import annotations

from .config import LaunchConfig, make_launch_config
from .errors import LaunchError
from .launcher import launch
from .recording import RecordError, record
from .result import RankResult, RunFailed, RunResult


def run_script(script, **options) -> RunResult:
    """`launch(make_launch_config(script, **options))`: run a script file on every rank.

    Example:
        >>> run = run_script("train.py", nproc=2)
        >>> run.ranks[0].stdout
    """
    return launch(make_launch_config(script, **options))


def load_ipython_extension(ipython) -> None:
    """`%load_ext ddp_helpers` registers the %%torchrun cell magic."""
    from .magic import register

    register(ipython)


__all__ = [
    "LaunchConfig", "LaunchError", "make_launch_config", "launch", "run_script",
    "RunResult", "RankResult", "RunFailed", "record", "RecordError", "load_ipython_extension",
]
