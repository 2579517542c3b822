"""The options of one launch: `make_launch_config` checks what every launch shares, and hands the rest to the
job that runs it (the local one unless another is named), which fills in its defaults; bad input becomes
one clear error before anything starts.

Defaults on this machine (`engines.local`):
- k >= 2 CUDA GPUs present: nproc = k, backend "nccl", one GPU per rank.
- fewer than 2 GPUs: nproc = 2 CPU processes, backend "gloo" (a world of one would show nothing of
  what several ranks do, and every check about several ranks would pass without proving anything).
- nproc given, backend not: nccl when there is a GPU for each rank, else CPU ranks with gloo.
- Asking for more ranks than GPUs with backend="nccl" is an error that names the CPU option.
- The run folder lives under the runs root (`runs_root()`), never among the user's files:
  `<runs root>/scripts/<script name>-<hash of its full path>/` for a script, chosen by the magic for a cell.
- The ranks' working directory is the run folder (fresh at each launch) unless `cwd` is given.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from .engines import BACKENDS, RESERVED_ENV, RESERVED_ENV_PREFIXES, Job, LaunchConfig, LaunchRequest
from .default_job import Hardware, LocalJob
from .errors import LaunchError

# Below nbmake's 300 s per-cell limit, so that the launcher's own cleanup runs before nbmake kills the kernel.
DEFAULT_TIMEOUT_S = 120.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LaunchError(
            f"timeout must be a number of seconds (an int or float), got {type(value).__name__} {value!r}. "
            "Example: timeout_s=60 (magic: --timeout 60)"
        )
    if not (value > 0 and math.isfinite(value)):
        raise LaunchError(f"timeout must be a positive number of seconds, got {value!r}. Example: --timeout 60")
    return float(value)


def check_extra_env(extra_env: object) -> dict[str, str]:
    """extra_env as a plain dict of strings, or LaunchError naming the entry to fix."""
    if extra_env is None:
        return {}
    if not isinstance(extra_env, Mapping):
        raise LaunchError(f"extra_env must be a dict of variable names to strings, got {type(extra_env).__name__}.")
    for key, value in extra_env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise LaunchError(f"extra_env: {key!r} is not an environment variable name (letters, digits, '_').")
        if not isinstance(value, str):
            raise LaunchError(
                f"extra_env[{key!r}] must be a string, got {type(value).__name__} {value!r}: "
                f"write it as {str(value)!r} if that is what you mean."
            )
        if "\0" in value:
            raise LaunchError(f"extra_env[{key!r}] contains a NUL character, which no environment can hold.")
        if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
            raise LaunchError(
                f"extra_env may not set {key}: the launcher (or torchrun, for each rank) sets it, and the run "
                "depends on its value. Pass your own variable under another name."
            )
    return dict(extra_env)


def make_launch_config(
    script: str | os.PathLike,
    *,
    nproc: int | str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    run_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    extra_env: Mapping[str, str] | None = None,
    script_args: tuple[str, ...] = (),
    stream: bool = True,
    max_restarts: int = 0,
    import_dir: str | os.PathLike | None = None,
    job: Job | None = None,
    cold: bool = False,
    nnodes: int | str = 1,
    kill_rank: int | str | None = None,
    kill_after: str | None = None,
    join_after: str | None = None,
    hardware: Hardware | None = None,
) -> LaunchConfig:
    """Validate a launch request; the job that runs it fills in its defaults.

    Args:
        script: path of the script every rank runs; must exist.
        nproc: ranks each agent (machine) starts; default one per GPU with 2 or more GPUs, else 2 CPU
            processes.
        backend: "nccl" or "gloo"; default nccl when there is a GPU for each rank (and at least 2),
            gloo otherwise. With GPUs present, backend="gloo" runs CPU processes (GPUs hidden from
            the ranks), any number of them.
        timeout_s: stop the run after this many seconds (default 120).
        run_dir: folder for per-run output; default `<runs root>/scripts/<script name>-<hash>/`. A folder
            that exists but was not made by ddp_helpers is refused at launch (it would be emptied).
        cwd: the ranks' working directory (e.g. "." for the notebook's folder); default the run folder,
            fresh at each launch.
        extra_env: environment variables for every rank.
        script_args: arguments passed to the script.
        stream: print each rank's output live.
        max_restarts: restart every rank up to this many times after a failure (torchrun's
            --max-restarts). Each restart runs the script from the start: it must resume from its own
            snapshot. Warning: torch's agent keeps the dead ranks' addresses in its store, and a restart
            can then fail to connect; the launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to avoid it.
        import_dir: a folder the ranks import from after the script's own (`%%torchrun` passes the
            notebook's folder).
        job: where and how it runs, a `engines.Job` such as `SlurmJob(nodes=2)`; the job checks its own options, and the GPUs of this machine then do not matter. By
            default, a run on this machine (`engines.local.LocalJob`) with the options below.
        cold, nnodes, kill_rank, kill_after, join_after, hardware: a run on this machine's options (see
            `LocalJob`): fresh interpreters only; agents on loopback standing for machines; SIGKILL rank
            `kill_rank` once it has printed `kill_after`; agents 1 .. nnodes - 1 joining once rank 0 has
            printed `join_after`; the devices to plan for (detected when omitted).

    Raises:
        LaunchError: bad nproc or timeout, unknown backend, a missing script or cwd, more nccl ranks
            than GPUs, extra_env with non-string values or the launcher's own variables, or a run on this
            machine's options given with another job.

    Example:
        >>> config = make_launch_config("train.py", nproc=2, backend="gloo")
    """
    here = LocalJob(nnodes=nnodes, kill_rank=kill_rank, kill_after=kill_after, join_after=join_after, warm=not cold,
                    hardware=hardware)
    if job is None:
        job = here
    elif not isinstance(job, Job):
        raise LaunchError(f"job must be a job (an engines.Job), got {type(job).__name__}.")
    elif not isinstance(job, LocalJob) and here.options_given():
        raise LaunchError(f"{here.options_given()[0]} is for {LocalJob.label}, not for {type(job).label}.")
    request = _checked_request(
        script, timeout_s=timeout_s, run_dir=run_dir, cwd=cwd, extra_env=extra_env, script_args=script_args,
        stream=stream, max_restarts=max_restarts, nproc=nproc, backend=backend, import_dir=import_dir)
    return job.launch_config(request)


def _checked_request(script, *, timeout_s, run_dir, cwd, extra_env, script_args, stream, max_restarts, nproc,
                     backend, import_dir) -> LaunchRequest:
    """What every launch checks, wherever it runs."""
    script_path = Path(script).expanduser().resolve()
    if not script_path.is_file():
        raise LaunchError(f"Script not found: {script_path}. Check the path (relative paths start at {Path.cwd()}).")
    if backend is not None and backend not in BACKENDS:
        raise LaunchError(f"Unknown backend {backend!r}: use 'nccl' (one GPU per rank) or 'gloo' (CPU processes).")
    timeout_s = parse_timeout(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= 10:
        raise LaunchError(f"max_restarts must be a whole number from 0 to 10, got {max_restarts!r}.")
    env = check_extra_env(extra_env)
    if "PYTHONUNBUFFERED" in env:
        raise LaunchError("extra_env may not set PYTHONUNBUFFERED: the launcher sets it to 1, so that every "
                          "rank's output streams into the notebook as it is printed.")
    working_dir = None
    if cwd is not None:
        working_dir = Path(cwd).expanduser().resolve()
        if not working_dir.is_dir():
            raise LaunchError(f"cwd {working_dir} is not a folder. Example: cwd='.' for the notebook's folder.")
    return LaunchRequest(
        script=script_path, timeout_s=timeout_s, run_dir=Path(os.path.abspath(Path(run_dir).expanduser())) if run_dir else None,
        cwd=working_dir, extra_env=env, script_args=tuple(str(a) for a in script_args), stream=stream,
        max_restarts=max_restarts, nproc=nproc, backend=backend,
        import_dir=Path(import_dir).expanduser().resolve() if import_dir is not None else None)
