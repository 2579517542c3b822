"""ddp_helpers: run notebook cells on every rank under torchrun, and read back what each rank did.

Public API (see docs/launcher.md):
    make_launch_config, launch, run_script   launch a script; get a RunResult
    SlurmJob                                 make_launch_config(script, job=SlurmJob(nodes=2)); any registered
                                             job by its class name (`engines.register_job`)
    RunResult, RankResult, RunFailed, LaunchError
    detect_hardware                          this machine's GPUs, as the default job plans for them
    record, RecordError                      script side: save a value for the notebook
    rank_secret                              script side: a number only this rank is handed (exercises' data)
    %load_ext ddp_helpers                    the %%torchrun cell magic

This module stays light: ranks import it to call `record`, which loads only `recording` and the run
folder's module; the launcher's side (launch_options, launcher, result) loads on first use of its names.
"""

from __future__ import annotations

import importlib

from .recording import RecordError, rank_secret, record

# Name -> module, loaded when first asked for (PEP 562): a rank never loads the launcher.
_LAUNCHER_SIDE = {
    "LaunchConfig": "engines", "make_launch_config": "launch_options", "LaunchError": "errors", "launch": "launcher",
    "detect_hardware": "default_job",
    "RunResult": "result", "RankResult": "result", "RunFailed": "result",
}


def __getattr__(name: str):
    if name in _LAUNCHER_SIDE:
        value = getattr(importlib.import_module(f".{_LAUNCHER_SIDE[name]}", __name__), name)
        globals()[name] = value
        return value
    if name.endswith("Job"):  # a registered job class, by its name
        job = importlib.import_module(".engines", __name__).job_named(name)
        if job is not None:
            globals()[name] = job
            return job
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_script(script, **options) -> "RunResult":
    """`launch(make_launch_config(script, **options))`: run a script file on every rank.

    Example:
        >>> run = run_script("train.py", nproc=2)
        >>> run.ranks[0].stdout
    """
    from .launch_options import make_launch_config
    from .launcher import launch

    return launch(make_launch_config(script, **options))


def load_ipython_extension(ipython, name: str = __name__) -> None:
    """`%load_ext ddp_helpers` registers the %%torchrun cell magic, and starts the warm process the
    launches fork their ranks from (in the background: it is ready a few seconds later). `name`: the
    extension IPython loaded (`ddp_helpers.course` loads this one too)."""
    from .default_job import prepare_warm_launches
    from .magic import register

    register(ipython)
    prepare_warm_launches(timeout_s=None)
    # Run All again in the same kernel runs `%load_ext ddp_helpers` again: quietly, not with IPython's
    # "already loaded" note (loading again is harmless: the magic and the warm process are reused). IPython
    # marks the extension loaded once this returns, so the mark is taken off after the cell.
    events, manager = getattr(ipython, "events", None), getattr(ipython, "extension_manager", None)
    if events is not None and manager is not None:
        def forget_loaded(*_):
            manager.loaded.discard(name)
            events.unregister("post_run_cell", forget_loaded)

        events.register("post_run_cell", forget_loaded)


__all__ = [
    "LaunchConfig", "LaunchError", "make_launch_config", "launch", "run_script", "detect_hardware",
    "RunResult", "RankResult", "RunFailed", "record", "RecordError", "rank_secret", "load_ipython_extension",
]
