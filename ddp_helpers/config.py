"""What one launch is: the frozen `LaunchConfig`, and `make_launch_config`, which fills in defaults
from the hardware found and turns bad input into one clear error before anything starts.

Defaults:
- k CUDA GPUs present: nproc = k, backend "nccl", one GPU per rank.
- no GPU: nproc = 2 CPU processes, backend "gloo".
- Asking for more ranks than GPUs with nccl is an error that names the CPU option (backend="gloo").
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Below nbmake's 300 s per-cell limit, so that the launcher's own cleanup runs before nbmake kills the kernel.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CPU_NPROC = 2
BACKENDS = ("gloo", "nccl")


class LaunchError(ValueError):
    """Bad launch input, reported before any process starts."""


@dataclass(frozen=True)
class Hardware:
    """The devices this machine offers to a launch."""

    gpu_names: tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    def describe(self) -> str:
        if not self.gpu_names:
            return "no CUDA GPU: ranks run as CPU processes and talk over gloo"
        listing = ", ".join(f"cuda:{i} {name}" for i, name in enumerate(self.gpu_names))
        return f"{self.gpu_count} CUDA GPU(s): {listing}; ranks use nccl, one GPU each"


def detect_hardware() -> Hardware:
    """Find the CUDA GPUs without creating a CUDA context in this process (a context here would be
    inherited by nothing, but costs memory and time on every GPU)."""
    import torch

    count = torch.cuda.device_count()
    return Hardware(tuple(torch.cuda.get_device_name(i) for i in range(count)))


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of a script on `nproc` ranks under torchrun.

    Args:
        script (Path): the Python file every rank runs.
        nproc (int): number of ranks (processes) on this machine.
        backend (str): "gloo" (CPU processes) or "nccl" (one GPU per rank).
        timeout_s (float): the run is stopped, with a stack dump of every live rank, after this long.
        run_dir (Path): per-run output (each rank's stdout/stderr, recorded facts); emptied at launch.
        extra_env (Mapping[str, str]): environment variables added for every rank.
        script_args (tuple[str, ...]): command-line arguments passed to the script.
        stream (bool): print each rank's output live, prefixed by its rank.

    Build it with `make_launch_config`, which fills in defaults from the hardware and validates.
    """

    script: Path
    nproc: int
    backend: str
    timeout_s: float
    run_dir: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)
    script_args: tuple[str, ...] = ()
    stream: bool = True

    def __post_init__(self) -> None:
        # Freeze the environment mapping too, so a config can be shared without surprises.
        object.__setattr__(self, "extra_env", types.MappingProxyType(dict(self.extra_env)))


def parse_nproc(value: object) -> int:
    """Turn user input ("4", 4) into a rank count, or raise LaunchError saying what is accepted."""
    if isinstance(value, bool):
        value = str(value)
    try:
        nproc = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise LaunchError(
            f"nproc must be a whole number of processes (1 or more), got {value!r}. Example: --nproc 2"
        ) from None
    if nproc < 1:
        raise LaunchError(f"nproc must be 1 or more processes, got {nproc}. Example: --nproc 2")
    return nproc


def make_launch_config(
    script: str | os.PathLike,
    *,
    nproc: int | str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
    run_dir: str | os.PathLike | None = None,
    extra_env: Mapping[str, str] | None = None,
    script_args: tuple[str, ...] = (),
    stream: bool = True,
    hardware: Hardware | None = None,
) -> LaunchConfig:
    """Validate a launch request and fill in its defaults from the hardware present.

    Args:
        script: path of the script every rank runs; must exist.
        nproc: ranks to start; default one per GPU, or 2 CPU processes without GPUs.
        backend: "nccl" or "gloo"; default nccl with GPUs, gloo without. With GPUs present,
            backend="gloo" runs CPU processes (GPUs hidden from the ranks), any number of them.
        timeout_s: stop the run after this many seconds (default 120).
        run_dir: folder for per-run output; default `<script folder>/<script name>/`.
        extra_env: environment variables for every rank.
        script_args: arguments passed to the script.
        stream: print each rank's output live.
        hardware: the devices to plan for; detected when omitted.

    Raises:
        LaunchError: bad nproc, unknown backend, a missing script, or more nccl ranks than GPUs.

    Example:
        >>> config = make_launch_config("train.py", nproc=2, backend="gloo")
    """
    script_path = Path(script).expanduser().resolve()
    if not script_path.is_file():
        raise LaunchError(f"Script not found: {script_path}. Check the path (relative paths start at {Path.cwd()}).")
    if backend is not None and backend not in BACKENDS:
        raise LaunchError(f"Unknown backend {backend!r}: use 'nccl' (one GPU per rank) or 'gloo' (CPU processes).")
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S
    if not timeout_s > 0:
        raise LaunchError(f"timeout must be a positive number of seconds, got {timeout_s!r}.")

    hardware = hardware or detect_hardware()
    if backend is None:
        backend = "nccl" if hardware.gpu_count else "gloo"
    if backend == "nccl" and hardware.gpu_count == 0:
        raise LaunchError(
            "backend 'nccl' needs CUDA GPUs and none was found. Use backend='gloo' (magic: --backend gloo) "
            "to run the ranks as CPU processes."
        )
    if nproc is None:
        nproc = hardware.gpu_count if backend == "nccl" else DEFAULT_CPU_NPROC
    nproc = parse_nproc(nproc)
    if backend == "nccl":
        if nproc > hardware.gpu_count:
            raise LaunchError(
                f"{nproc} ranks asked for but only {hardware.gpu_count} GPU(s) found: with nccl each rank needs "
                f"its own GPU. Use nproc <= {hardware.gpu_count}, or backend='gloo' (magic: --backend gloo) "
                "to run the ranks as CPU processes."
            )

    env = dict(extra_env or {})
    if backend == "gloo" and hardware.gpu_count:
        # CPU ranks on a GPU machine: hide the GPUs so `torch.cuda.is_available()` picks the CPU path.
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return LaunchConfig(
        script=script_path,
        nproc=nproc,
        backend=backend,
        timeout_s=float(timeout_s),
        run_dir=Path(run_dir).resolve() if run_dir else script_path.with_suffix(""),
        extra_env=env,
        script_args=tuple(script_args),
        stream=stream,
    )
