"""Launching a script on every rank under torchrun, and cleaning up after it whatever happens.

    from ddp_helpers import make_launch_config, launch
    run = launch(make_launch_config("train.py", nproc=2))
    run.ranks[1].stdout, run.ranks[1].facts["loss"], run.ok

How: `python -m torch.distributed.run --standalone` with the caller's own interpreter, so the ranks see
the same packages as the notebook; the OS picks the rendezvous port, so launches never collide.
Each rank runs the script through `ddp_helpers._bootstrap` (its output goes to per-rank files that
are streamed here live, prefixed by rank).

Failure handling:
- A rank raises: torchrun stops the other ranks; the result names the rank that failed first and
  carries its Python traceback.
- The run exceeds `timeout_s`: every live rank dumps its stack (SIGUSR1, faulthandler), then the run
  is stopped.
- KeyboardInterrupt (the notebook's stop button): the run is stopped, then the interrupt goes on.
- The launching process is killed outright: torchrun and the ranks die with it (parent-death signal).
Whatever the ending, any process still carrying the run's marker is killed, and torchrun's temporary
folder is removed.

Network: gloo and nccl sockets are kept on loopback (GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo);
torchrun's rendezvous store (a TCPStore in the torchrun process) still listens on all interfaces
on an OS-chosen port for the duration of the run, as every torchrun launch does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .config import LaunchConfig
from .output import RankOutputStreamer
from .processes import kill_marked, stop_process_group
from .recording import read_facts
from .result import RankError, RankResult, RunResult
from .run_files import RUN_DIR_ENV, RUN_ID_ENV, rank_file, read_json

# Variables a kernel started under torchrun would pass on: the child launch must start its own world.
_INHERITED_DIST_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", RUN_DIR_ENV, RUN_ID_ENV,
)
_INHERITED_DIST_PREFIXES = ("TORCHELASTIC_",)
_POLL_INTERVAL_S = 0.05
_STACK_DUMP_WAIT_S = 1.5


def child_environment(config: LaunchConfig, run_id: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun and the ranks get: the caller's, minus any distributed settings it
    inherited, plus the run's markers and loopback-only sockets, plus `config.extra_env`."""
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if key not in _INHERITED_DIST_VARS and not key.startswith(_INHERITED_DIST_PREFIXES)
    }
    package_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.update(
        {
            RUN_DIR_ENV: str(config.run_dir),
            RUN_ID_ENV: run_id,
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
            # Ranks have no display; the kernel's inline backend would drag IPython into every rank.
            "MPLBACKEND": "Agg",
        }
    )
    # torchrun sets 1 thread per rank anyway (and warns); saying so ourselves keeps the output clean.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(config.extra_env)
    return env


def torchrun_command(config: LaunchConfig) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(config.nproc),
        "--max-restarts", "0",
        "--monitor-interval", "0.1",
        "--local-addr", "127.0.0.1",
        "--log-dir", str(config.run_dir / "torchelastic"),
        "-m", "ddp_helpers._bootstrap",
        str(config.script), *config.script_args,
    ]


def _prepare_run_dir(run_dir: Path) -> None:
    # Stale output of an earlier run would be read back as this run's facts: start empty.
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


def _dump_stacks_of_live_ranks(config: LaunchConfig) -> None:
    print(
        f"[ddp_helpers] no result after {config.timeout_s:.0f} s: asking every live rank for its stack, "
        "then stopping the run.",
        file=sys.stderr,
        flush=True,
    )
    for rank in range(config.nproc):
        try:
            os.kill(int(rank_file(config.run_dir, rank, "pid").read_text()), signal.SIGUSR1)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            pass  # not started, or already gone


def launch(config: LaunchConfig) -> RunResult:
    """Run `config.script` on `config.nproc` ranks and wait for it (at most `config.timeout_s`).

    Args:
        config (LaunchConfig): from `make_launch_config`.

    Returns:
        RunResult: per rank its exit code, output and recorded facts. A failed run is returned, not
        raised: call `run.raise_for_failure()` or check `run.ok`.

    Warning:
        Do not initialise CUDA in the calling process before launching on GPUs (nothing here does).
    """
    run_id = uuid.uuid4().hex
    _prepare_run_dir(config.run_dir)
    color = sys.stdout.isatty() or "ipykernel" in sys.modules
    streamer = RankOutputStreamer(config.run_dir, config.nproc, enabled=config.stream, color=color)
    start = time.monotonic()
    timed_out = False
    log_path = config.run_dir / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_helpers.processes", str(os.getpid()), *torchrun_command(config)],
            env=child_environment(config, run_id),
            cwd=config.run_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stopping it reaches nothing of ours
        )
        try:
            deadline = start + config.timeout_s
            while proc.poll() is None:
                streamer.poll()
                if time.monotonic() > deadline:
                    timed_out = True
                    _dump_stacks_of_live_ranks(config)
                    _wait_for(proc, _STACK_DUMP_WAIT_S, streamer)
                    break
                time.sleep(_POLL_INTERVAL_S)
        finally:  # normal end, timeout, KeyboardInterrupt or any error here: nothing of the run survives
            stop_process_group(proc)
            kill_marked(run_id, RUN_ID_ENV)
            streamer.finish()
            shutil.rmtree(config.run_dir / "torchelastic", ignore_errors=True)
    return _collect_result(config, proc.returncode, time.monotonic() - start, timed_out, log_path)


def _wait_for(proc: subprocess.Popen, seconds: float, streamer: RankOutputStreamer) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until and proc.poll() is None:
        streamer.poll()
        time.sleep(_POLL_INTERVAL_S)


# torchrun's failure summary: "rank      : 2 (local_rank: 2)" then "exitcode  : -15 (pid: 123)".
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)")


def exit_codes_from_torchrun_log(log: str) -> dict[int, int]:
    """Exit codes torchrun reports for failed or stopped workers (negative: killed by that signal)."""
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(log)}


def _collect_result(
    config: LaunchConfig, returncode: int | None, wall_time_s: float, timed_out: bool, log_path: Path
) -> RunResult:
    launcher_log = _read_text(log_path)
    # A rank reports its own exit code; one killed from outside cannot, but torchrun saw how it ended.
    seen_by_torchrun = exit_codes_from_torchrun_log(launcher_log)
    ranks = []
    for rank in range(config.nproc):
        ended = read_json(rank_file(config.run_dir, rank, "exit.json"))
        error = read_json(rank_file(config.run_dir, rank, "error.json"))
        ranks.append(
            RankResult(
                rank=rank,
                exit_code=ended["exit_code"] if ended else seen_by_torchrun.get(rank),
                stdout=_read_text(rank_file(config.run_dir, rank, "stdout")),
                stderr=_read_text(rank_file(config.run_dir, rank, "stderr")),
                facts=read_facts(config.run_dir, rank),
                error=RankError(error["type"], error["message"], error["traceback"], error["time"]) if error else None,
            )
        )
    devices = tuple(f"cuda:{r}" if config.backend == "nccl" else "cpu" for r in range(config.nproc))
    return RunResult(
        config=config,
        ranks=tuple(ranks),
        wall_time_s=wall_time_s,
        backend=config.backend,
        devices=devices,
        returncode=returncode,
        timed_out=timed_out,
        launcher_log=launcher_log,
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
