"""Launching a script on every rank under torchrun: start, watch, stop. Whatever happens, nothing of
the run survives it, and nothing of the user's is touched.

    from ddp_helpers import make_launch_config, launch
    run = launch(make_launch_config("train.py", nproc=2))
    run.ranks[1].stdout, run.ranks[1].facts["loss"], run.ok

How: the kernel starts `python -m ddp_helpers.supervisor`, which runs torchrun's agent (a c10d
rendezvous on a store the supervisor hosts on loopback and a port the OS picks, so launches never
collide and nothing listens beyond this machine) with the caller's own
interpreter, so the ranks see the same packages as the notebook. Each rank runs the script through
`ddp_helpers._bootstrap`; its output is capped by the supervisor into the run folder and streamed
here live, prefixed by rank. The run folder (`run_folder.RunFolder`) is claimed for the launch:
created and marked by ddp_helpers, or refused; locked, so a concurrent launch cannot mix its files in.

Failure handling:
- A rank raises or is killed: torchrun stops the other ranks; the result names the rank that failed
  first and carries its Python traceback, or the signal that killed it.
- The run exceeds `timeout_s`: every live rank dumps its stack (SIGUSR1, faulthandler); once the dumps
  are written (at most STACK_DUMP_WAIT_S) the run is stopped.
- KeyboardInterrupt (the notebook's stop button, once or several times): the run is stopped, then
  the interrupt goes on.
- Stopping takes at most SHUTDOWN_GRACE_S for the ranks to end on SIGTERM, then everything is killed:
  every process of a run is gone within STOP_BOUND_S of the stop.
- The kernel is killed outright: the supervisor (which outlives it) stops the run and sweeps.
Whatever the ending, any process still carrying the run's marker is killed.

Network: gloo and nccl sockets are kept on loopback (GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo);
torchrun's rendezvous store (a TCPStore in the supervisor) still listens on all interfaces on an
OS-chosen port for the duration of the run, as every torchrun launch does.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .config import LaunchConfig, inherited_environment
from .output import RankOutputStreamer, TextInFile, show_failures_once
from .processes import kill_marked, kill_process_groups, process_is_dead, stop_process_group
from .readback import collect_result
from .result import RunResult
from .run_folder import AGENT_GPUS_ENV, JOIN_AFTER_ENV, RUN_DIR_ENV, RUN_ID_ENV, RunFolder
from . import hang, warm
from .warm import WarmProcess, current_umask, warm_zygote, what_happened_to_the_warm_process

_STUB = str(Path(__file__).resolve().parent / "_zygote_stub.py")
# Variables that differ from launch to launch: not part of the warm process's environment.
RUN_ENV_KEYS = (RUN_DIR_ENV, RUN_ID_ENV)

_POLL_INTERVAL_S = 0.05
# The ranks get this long to end after SIGTERM (torchrun's --shutdown-timeout), then SIGKILL.
SHUTDOWN_GRACE_S = 3
# The supervisor gets this long on top to stop the agent and sweep, then it is killed too.
_SUPERVISOR_EXTRA_S = 4
# Every process of a stopped run is gone within this bound (stated in the README; a test holds it).
STOP_BOUND_S = 15
STACK_DUMP_WAIT_S = 5.0
HANG_REPORT_WAIT_S = 5.0  # for the ranks to say what they wait in (a thread of each answers within about 1 s)


def child_environment(config: LaunchConfig, run_id: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the supervisor and the ranks get: the caller's, minus any distributed settings it
    inherited, plus `config.extra_env`, plus the run's markers and loopback-only sockets."""
    env = inherited_environment(base)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets 1 thread per rank anyway (and warns)
    env["MPLBACKEND"] = "Agg"  # ranks have no display; the kernel's inline backend would drag IPython in
    if config.max_restarts or config.nnodes > 1:
        # Without it the agent's shared store keeps the dead ranks' addresses and restarts fail to connect
        # (pytorch issues 135712, 167288): 7 of 10 restarts failed here, 0 of 12 with it. Agents joining
        # or leaving a rendezvous need it too.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if config.nnodes > 1 and config.backend == "nccl":
        # Each agent stands for a machine with its own GPUs: agent k gets the k-th nproc of them.
        visible = (env.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(config.world_size)))).split(",")
        env[AGENT_GPUS_ENV] = ";".join(",".join(visible[k * config.nproc:(k + 1) * config.nproc])
                                       for k in range(config.nnodes))
    env.update(config.extra_env)
    package_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env.update(
        {
            RUN_DIR_ENV: str(config.run_dir),
            RUN_ID_ENV: run_id,
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
        }
    )
    if config.join_after:
        env[JOIN_AFTER_ENV] = config.join_after
    return env


def supervisor_arguments(config: LaunchConfig, parent_pid: int, zygote_socket: str | None = None) -> list[str]:
    """`ddp_helpers.supervisor`'s arguments: the process to die with, the grace, then torchrun's. With a
    zygote, torchrun starts each worker through `_zygote_stub` (no torch import), which has the zygote fork it."""
    worker = ["-m", "ddp_helpers._bootstrap", str(config.script), *config.script_args]
    if zygote_socket is not None:
        worker = ["--no-python", sys.executable, "-S", "-u", _STUB, zygote_socket, *worker]
    return [
        str(parent_pid), str(SHUTDOWN_GRACE_S), "--",
        # The supervisor adds a c10d rendezvous on a store it hosts, on loopback and a port the OS picks.
        "--nnodes", f"1:{config.nnodes}" if config.join_after else str(config.nnodes),
        "--nproc-per-node", str(config.nproc),
        "--max-restarts", str(config.max_restarts),
        "--monitor-interval", "0.1",
        "--local-addr", "127.0.0.1",
        "--log-dir", str(config.run_dir / "torchelastic"),
        *worker,
    ]


def _start_supervisor(config: LaunchConfig, env: dict[str, str], log) -> subprocess.Popen | WarmProcess:
    """Fork the supervisor from the zygote when the launch can be warm; else start a fresh interpreter."""
    zygote = None
    if config.warm:
        without_cell_env = child_environment(dataclasses.replace(config, extra_env={}), env.get(RUN_ID_ENV, ""))
        zygote = warm_zygote(env, RUN_ENV_KEYS, without_cell_env)
    if zygote is not None:
        request = {"role": "supervisor", "argv": supervisor_arguments(config, zygote.process.pid, zygote.socket_path),
                   "env": env, "cwd": str(config.working_dir), "umask": current_umask()}
        with open(os.devnull, "rb") as devnull:
            try:
                return WarmProcess.start(zygote.socket_path, request, (devnull.fileno(), log.fileno(), log.fileno()))
            except (OSError, ValueError) as error:  # ValueError: a garbled answer
                zygote.note(f"the warm process could not start the run ({error})")
    return subprocess.Popen(
        [sys.executable, "-m", "ddp_helpers.supervisor", *supervisor_arguments(config, os.getpid())],
        env=env,
        cwd=config.working_dir,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the stop button's SIGINT reaches only us
    )


def launch(config: LaunchConfig, folder: RunFolder | None = None) -> RunResult:
    """Run `config.script` on `config.nproc` ranks and wait for it (at most `config.timeout_s`).

    Args:
        config (LaunchConfig): from `make_launch_config`.
        folder (RunFolder | None): `config.run_dir`, already claimed by the caller (the magic claims it
            before writing the cell's script); claimed and released here when omitted.

    Returns:
        RunResult: per rank its exit code, output and recorded facts. A failed run is returned, not
        raised: call `run.raise_for_failure()` or check `run.ok`.

    Raises:
        LaunchError: the run folder exists but was not made by ddp_helpers, or another launch is using it.

    Warning:
        Do not initialise CUDA in the calling process before launching on GPUs (nothing here does).
    """
    own_folder = folder is None
    if own_folder:
        folder = RunFolder.claim(config.run_dir)
    try:
        if config.slurm is not None:
            from .slurm import launch_on_slurm

            return launch_on_slurm(config, folder)
        return _launch_in(config, folder)
    finally:
        if own_folder:
            folder.release()


def _launch_in(config: LaunchConfig, folder: RunFolder) -> RunResult:
    run_id = uuid.uuid4().hex
    folder.start_launch(run_id)
    color = sys.stdout.isatty() or "ipykernel" in sys.modules
    streamer = RankOutputStreamer(folder, config.world_size, enabled=config.stream, color=color)
    killer = RankKiller(config, folder) if config.kill_rank is not None else None
    start = time.monotonic()
    timed_out = False
    with open(folder.torchrun_log, "wb") as log:
        proc = _start_supervisor(config, child_environment(config, run_id), log)
        try:
            deadline = start + config.timeout_s
            while proc.poll() is None:
                streamer.poll()
                if killer is not None:
                    killer.poll()
                if time.monotonic() > deadline:
                    timed_out = True
                    _dump_stacks_of_live_ranks(config, folder, streamer)
                    break
                time.sleep(_POLL_INTERVAL_S)
        finally:  # normal end, timeout, KeyboardInterrupt (stop button) or any error: nothing of the run survives
            _stop_run(proc, run_id, streamer, folder, config.world_size)
    returncode = proc.returncode
    if isinstance(proc, WarmProcess):
        note = what_happened_to_the_warm_process(proc)
        if note:
            print(f"[ddp_helpers] {note}", file=sys.stderr, flush=True)
        if proc.unreported:  # the supervisor's exit code was lost with the warm process: it is its outcome's
            returncode = 0 if (folder.read_outcome() or {}).get("succeeded") else 1
    result = collect_result(
        config, folder, returncode=returncode, wall_time_s=time.monotonic() - start,
        timed_out=timed_out,
    )
    show_failures_once(streamer, result)
    return result


class RankKiller:
    """SIGKILLs `config.kill_rank` once, as soon as its first attempt has printed `config.kill_after`."""

    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self._rank, self._text, self._folder = config.kill_rank, config.kill_after, folder
        self._printed = TextInFile(folder.output(config.kill_rank, "stdout"), config.kill_after)
        self.done = False

    def poll(self) -> None:
        if self.done or not self._printed.seen():
            return
        identity = self._folder.read_identity(self._rank)
        if identity is not None and identity.restart == 0:
            print(f"[ddp_helpers] killing rank {self._rank} (SIGKILL, as the out-of-memory killer would): it printed "
                  f"{self._text!r}", file=sys.stderr, flush=True)
            try:
                os.kill(identity.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.done = True


def _stop_run(proc, run_id: str, streamer: RankOutputStreamer, folder: RunFolder, nproc: int) -> None:
    """Bounded by STOP_BOUND_S; pressing stop again meanwhile does not cut it short."""
    interrupted = None
    try:
        stop_process_group(proc, grace_s=SHUTDOWN_GRACE_S + _SUPERVISOR_EXTRA_S)
    except KeyboardInterrupt as again:
        interrupted = again
    while True:
        try:
            kill_marked(run_id, RUN_ID_ENV)
            kill_process_groups(folder.rank_pids(nproc))
            streamer.finish()
            break
        except KeyboardInterrupt as again:
            interrupted = again
    if interrupted is not None:
        raise interrupted


def _dump_stacks_of_live_ranks(config: LaunchConfig, folder: RunFolder, streamer: RankOutputStreamer) -> None:
    """SIGUSR1 to every live rank (faulthandler writes its stack to rankN.stack), then wait until each
    asked rank's dump is written (it stops growing), at most STACK_DUMP_WAIT_S."""
    print(
        f"[ddp_helpers] no result after {config.timeout_s:g} s: asking every live rank for its stack, "
        "then stopping the run.",
        file=sys.stderr,
        flush=True,
    )
    live = [rank for rank in range(config.world_size)
            if (pid := folder.rank_pid(rank)) is not None and not process_is_dead(pid)]
    # First what each rank waits in (a thread of the rank answers), then the stacks: faulthandler reads
    # other threads' frames unlocked, so the rank's answering thread must be idle again when it dumps.
    reporting = hang.ask_ranks(folder, live)
    until = time.monotonic() + HANG_REPORT_WAIT_S
    while reporting and time.monotonic() < until:
        streamer.poll()
        time.sleep(_POLL_INTERVAL_S)
        if all(folder.hang_answered(rank) for rank in reporting):
            time.sleep(_POLL_INTERVAL_S)  # the thread is back, blocked on its pipe
            break
    asked = []
    for rank in live:
        try:
            os.kill(folder.rank_pid(rank), signal.SIGUSR1)
            asked.append(rank)
        except (ProcessLookupError, PermissionError):
            pass
    sizes: dict[int, int] = {}
    until = time.monotonic() + STACK_DUMP_WAIT_S
    while asked and time.monotonic() < until:
        streamer.poll()
        time.sleep(_POLL_INTERVAL_S)
        now = {rank: _size(folder.stack_file(rank)) for rank in asked}
        if all(size > 0 and sizes.get(rank) == size for rank, size in now.items()):
            break  # every dump written, none still growing
        sizes = now


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def prepare_warm_launches(timeout_s: float = 60) -> bool:
    """Start the warm process now and wait until it is ready, so the next launch is warm (otherwise the
    first launch of a process starts it and runs cold). Returns True when it is ready."""
    defaults = LaunchConfig(Path(__file__), 1, "gloo", 1.0, Path(os.sep))
    return warm.prepare_warm_launches(child_environment(defaults, ""), RUN_ENV_KEYS, timeout_s)
