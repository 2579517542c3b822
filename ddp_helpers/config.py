"""What one launch is: the frozen `LaunchConfig`, and `make_launch_config`, which fills in defaults
from the hardware found and turns bad input into one clear error before anything starts.

Defaults:
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

import hashlib
import math
import dataclasses
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .engine import ClusterJob, LaunchRequest
from .errors import LaunchError

# Below nbmake's 300 s per-cell limit, so that the launcher's own cleanup runs before nbmake kills the kernel.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CPU_NPROC = 2
MAX_NNODES = 8
BACKENDS = ("gloo", "nccl")
# Variables the launcher sets itself (or torchrun sets per rank): extra_env may not override them.
RESERVED_ENV_PREFIXES = ("DDP_HELPERS_", "TORCHELASTIC_")
RESERVED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def inherited_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without the variables a launcher or torchrun sets: a
    kernel started under torchrun would otherwise pass its own RANK, MASTER_PORT, ... to the ranks."""
    return {key: value for key, value in (os.environ if base is None else base).items()
            if key not in RESERVED_ENV and not key.startswith(RESERVED_ENV_PREFIXES)}


def runs_root() -> Path:
    """Where generated scripts and run folders go: $DDP_HELPERS_RUNS if set, else `runs/` in the project
    (or in the current folder when ddp_helpers is installed elsewhere)."""
    if os.environ.get("DDP_HELPERS_RUNS"):
        # Not resolved: a symbolic link placed there is refused by the launch (`private_folders`), not followed.
        return Path(os.path.abspath(Path(os.environ["DDP_HELPERS_RUNS"]).expanduser()))
    project = Path(__file__).resolve().parent.parent
    if (project / "pyproject.toml").is_file():
        return project / "runs"
    return Path.cwd() / "runs"


def default_run_dir(script: Path) -> Path:
    """A run folder of its own for each script path: two scripts with one name never share one."""
    digest = hashlib.sha1(str(script).encode()).hexdigest()[:8]
    return runs_root() / "scripts" / f"{script.stem}-{digest}"


def max_cpu_ranks() -> int:
    """More CPU ranks than this would only thrash the machine (each imports torch: ~300 MB)."""
    return max(8, 4 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class Hardware:
    """The devices this machine offers to a launch."""

    gpu_names: tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    @property
    def default_backend(self) -> str:
        """nccl with a GPU for each of at least 2 ranks; otherwise CPU ranks over gloo."""
        return "nccl" if self.gpu_count >= 2 else "gloo"

    def describe(self) -> str:
        if not self.gpu_names:
            return "no CUDA GPU: ranks run as CPU processes and talk over gloo"
        listing = ", ".join(f"cuda:{i} {name}" for i, name in enumerate(self.gpu_names))
        if self.gpu_count == 1:
            return (f"1 CUDA GPU ({listing}): one GPU makes a world of one, so by default the ranks run as 2 CPU "
                    "processes over gloo (--backend nccl -n 1 uses the GPU)")
        return f"{self.gpu_count} CUDA GPUs: {listing}; ranks use nccl, one GPU each"


def detect_hardware() -> Hardware:
    """Find the CUDA GPUs without creating a CUDA context in this process (a context here would be
    inherited by nothing, but costs memory and time on every GPU)."""
    import torch

    count = torch.cuda.device_count()
    return Hardware(tuple(torch.cuda.get_device_name(i) for i in range(count)))


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of a script on `world_size` ranks under torchrun: `nnodes` agents (machines), each
    starting `ranks_per_agent` ranks.

    Args:
        script (Path): the Python file every rank runs.
        ranks_per_agent (int): ranks (processes) each agent starts (torchrun's --nproc-per-node).
        backend (str): "gloo" (CPU processes) or "nccl" (one GPU per rank).
        timeout_s (float): the run is stopped, with a stack dump of every live rank, after this long.
        run_dir (Path): per-run output (each rank's stdout/stderr, recorded facts); emptied at launch,
            and only if ddp_helpers made it (see `run_folder`).
        cwd (Path | None): the ranks' working directory; None: the run folder.
        max_restarts (int): how many times torchrun restarts all ranks after one fails (its
            --max-restarts); 0: a failure ends the run.
        nnodes (int): torchrun agents, each standing for one machine, on this machine's loopback; each
            starts `ranks_per_agent` ranks, and they meet through one c10d rendezvous: a world of
            nnodes x ranks_per_agent.
        kill_rank (int | None), kill_after (str | None): SIGKILL global rank `kill_rank`, once, as soon as
            its output contains `kill_after` (as the out-of-memory killer would): for fault-tolerance demos.
        cluster (ClusterJob | None): run as a job on a cluster (`slurm.SlurmJob`) instead of on this
            machine (`nnodes` is then its number of nodes).
        join_after (str | None): elastic membership: agents 1 .. nnodes - 1 start only once rank 0's output
            contains this text, and the rendezvous accepts 1 to nnodes agents (torchrun --nnodes 1:N); the
            running ranks are restarted in the bigger world.
        warm (bool): fork the supervisor and the ranks from a process that has torch imported (see
            `warm`), where that gives the same result; False always starts fresh interpreters.
        extra_env (Mapping[str, str]): environment variables added for every rank.
        import_dir (Path | None): a folder on the ranks' sys.path after the script's own (a %%torchrun
            cell's notebook folder: what the kernel imports from there, the cell's ranks import too).
        script_args (tuple[str, ...]): command-line arguments passed to the script.
        stream (bool): print each rank's output live, prefixed by its rank.

    Build it with `make_launch_config`, which fills in defaults from the hardware and validates.
    """

    script: Path
    ranks_per_agent: int
    backend: str
    timeout_s: float
    run_dir: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)
    script_args: tuple[str, ...] = ()
    stream: bool = True
    cwd: Path | None = None
    warm: bool = True
    max_restarts: int = 0
    nnodes: int = 1
    kill_rank: int | None = None
    kill_after: str | None = None
    join_after: str | None = None
    cluster: ClusterJob | None = None
    import_dir: Path | None = None

    @property
    def working_dir(self) -> Path:
        return self.cwd or self.run_dir

    @property
    def world_size(self) -> int:
        return self.ranks_per_agent * self.nnodes

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
    if nproc > max_cpu_ranks():
        raise LaunchError(
            f"nproc {nproc} is more processes than this machine can run ({os.cpu_count()} CPU cores; at most "
            f"{max_cpu_ranks()} ranks here, each one a Python process with torch). Example: --nproc 2"
        )
    return nproc


def parse_nnodes(value: object) -> int:
    """torchrun agents ("machines") to start on loopback: a whole number from 1 to MAX_NNODES."""
    text = str(value).strip() if not isinstance(value, bool) else repr(value)
    if not re.fullmatch(r"\d+", text) or not 1 <= int(text) <= MAX_NNODES:
        raise LaunchError(f"nnodes must be a whole number of agents from 1 to {MAX_NNODES}, got {value!r}. "
                          "Example: --nnodes 2 (two agents standing for two machines)")
    return int(text)


def parse_kill(rank: object, after: object, world_size: int) -> tuple[int | None, str | None]:
    if rank is None and after is None:
        return None, None
    if rank is None or after is None:
        raise LaunchError("kill_rank and kill_after go together: which rank to kill, and the output text after "
                          "which to kill it. Example: --kill-rank 1 --kill-after 'step 5 done'")
    text = str(rank).strip() if not isinstance(rank, bool) else repr(rank)
    if not re.fullmatch(r"\d+", text) or int(text) >= world_size:
        raise LaunchError(f"kill_rank must be a rank of this run, 0 to {world_size - 1}, got {rank!r}.")
    if not isinstance(after, str) or not after.strip() or "\n" in after:
        raise LaunchError(f"kill_after must be a non-empty line of text the rank prints, got {after!r}.")
    return int(text), after


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
    cold: bool = False,
    max_restarts: int = 0,
    nnodes: int | str = 1,
    kill_rank: int | str | None = None,
    kill_after: str | None = None,
    join_after: str | None = None,
    cluster: ClusterJob | None = None,
    hardware: Hardware | None = None,
    import_dir: str | os.PathLike | None = None,
) -> LaunchConfig:
    """Validate a launch request and fill in its defaults from the hardware present.

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
        cold: start every process as a fresh interpreter (no warm launch; magic: --cold).
        max_restarts: restart every rank up to this many times after a failure (torchrun's
            --max-restarts). Each restart runs the script from the start: it must resume from its own
            snapshot. Warning: torch's agent keeps the dead ranks' addresses in its store, and a restart
            can then fail to connect; the launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to avoid it.
        nnodes: torchrun agents on this machine's loopback, each standing for a machine with `nproc` ranks
            (torchrun's --nnodes, with a c10d rendezvous); with nccl, each agent gets its own GPUs.
        kill_rank, kill_after: SIGKILL global rank `kill_rank` once, when its output first contains the
            text `kill_after` (say "step 5 done"): a worker lost mid-training, for restart demos.
        join_after: start agents 1 .. nnodes - 1 only once rank 0 has printed this text: they join the
            running job (torchrun --nnodes 1:nnodes), whose ranks restart in the bigger world.
        cluster: a cluster job, such as `SlurmJob(nodes=2)`: submit the launch to a cluster instead of
            running it here; the job checks its own options (see `slurm.SlurmJob`), and the GPUs of this
            machine do not matter.
        hardware: the devices to plan for; detected when omitted.
        import_dir: a folder the ranks import from after the script's own (`%%torchrun` passes the
            notebook's folder).

    Raises:
        LaunchError: bad nproc or timeout, unknown backend, a missing script or cwd, more nccl ranks
            than GPUs, or extra_env with non-string values or the launcher's own variables.

    Example:
        >>> config = make_launch_config("train.py", nproc=2, backend="gloo")
    """
    local_options = {"nnodes": str(nnodes).strip() != "1", "kill_rank": kill_rank is not None,
                     "kill_after": kill_after is not None, "join_after": join_after is not None}
    request = _checked_request(
        script, timeout_s=timeout_s, run_dir=run_dir, cwd=cwd, extra_env=extra_env, script_args=script_args,
        stream=stream, max_restarts=max_restarts, nproc=nproc, backend=backend,
        local_options=tuple(name for name, given in local_options.items() if given))
    if cluster is not None:
        if not isinstance(cluster, ClusterJob):
            raise LaunchError(f"cluster must be a cluster job such as SlurmJob(nodes=2), got {type(cluster).__name__}.")
        config = cluster.launch_config(request)
    else:
        config = _local_launch_config(request, nnodes=nnodes, kill_rank=kill_rank, kill_after=kill_after,
                                      join_after=join_after, cold=cold, hardware=hardware or detect_hardware())
    if import_dir is not None:
        config = dataclasses.replace(config, import_dir=Path(import_dir).expanduser().resolve())
    return config


def _checked_request(script, *, timeout_s, run_dir, cwd, extra_env, script_args, stream, max_restarts, nproc,
                     backend, local_options) -> LaunchRequest:
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
        max_restarts=max_restarts, nproc=nproc, backend=backend, local_options=local_options)


def _local_ranks(nproc, backend: str | None, nnodes: int, hardware: Hardware) -> tuple[int, str]:
    """(ranks per agent, backend) for a run on this machine, defaults from its GPUs."""
    if backend is None:
        wanted = DEFAULT_CPU_NPROC if nproc is None else parse_nproc(nproc)
        backend = (hardware.default_backend if nproc is None
                   else ("nccl" if wanted * nnodes <= hardware.gpu_count else "gloo"))
    if backend == "nccl" and hardware.gpu_count == 0:
        raise LaunchError(
            "backend 'nccl' needs CUDA GPUs and none was found. Use backend='gloo' (magic: --backend gloo) "
            "to run the ranks as CPU processes."
        )
    if nproc is None:
        nproc = max(1, hardware.gpu_count // nnodes) if backend == "nccl" else DEFAULT_CPU_NPROC
    nproc = parse_nproc(nproc)
    if backend == "nccl" and nproc * nnodes > hardware.gpu_count:
        raise LaunchError(
            f"{nproc * nnodes} ranks asked for but only {hardware.gpu_count} GPU(s) found: with nccl each rank "
            f"needs its own GPU. Use nproc x nnodes <= {hardware.gpu_count}, or backend='gloo' (magic: "
            "--backend gloo) to run the ranks as CPU processes."
        )
    if nproc * nnodes > max_cpu_ranks():
        raise LaunchError(f"{nnodes} agents x {nproc} ranks is more processes than this machine can run (at most "
                          f"{max_cpu_ranks()} ranks here). Example: --nnodes 2 --nproc 2")
    return nproc, backend


def _local_launch_config(request: LaunchRequest, *, nnodes, kill_rank, kill_after, join_after, cold: bool,
                         hardware: Hardware) -> LaunchConfig:
    """A launch on this machine: torchrun agents on loopback (see `local_engine`)."""
    env = dict(request.extra_env)
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if key in env:
            raise LaunchError(
                f"extra_env may not set {key} for a run on this machine: the launcher keeps gloo's and nccl's "
                "connections on loopback (lo), so that nothing of the run is reachable from the network. On a "
                "cluster (--slurm), set it to the nodes' network interface."
            )
    nnodes = parse_nnodes(nnodes)
    nproc, backend = _local_ranks(request.nproc, request.backend, nnodes, hardware)
    kill_rank, kill_after = parse_kill(kill_rank, kill_after, nproc * nnodes)
    if join_after is not None:
        if nnodes < 2:
            raise LaunchError("join_after needs agents to join: nnodes 2 or more. Example: --nnodes 2 --join-after "
                              "'step 5 done'")
        if not isinstance(join_after, str) or not join_after.strip() or "\n" in join_after:
            raise LaunchError(f"join_after must be a non-empty line of text rank 0 prints, got {join_after!r}.")
    if backend == "gloo" and hardware.gpu_count:
        # CPU ranks on a GPU machine: hide the GPUs so `torch.cuda.is_available()` picks the CPU path.
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return LaunchConfig(
        script=request.script, ranks_per_agent=nproc, backend=backend, timeout_s=request.timeout_s,
        run_dir=request.run_dir or default_run_dir(request.script), extra_env=env, script_args=request.script_args,
        stream=request.stream, cwd=request.cwd, warm=not cold, max_restarts=request.max_restarts, nnodes=nnodes,
        kill_rank=kill_rank, kill_after=kill_after, join_after=join_after,
    )
