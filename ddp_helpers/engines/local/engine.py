"""The local engine: torchrun agents on this machine, started through `ddp_helpers.engines.local.supervisor`.

How: the engine writes a `SupervisorSpec` into the run folder and starts the supervisor, cold (a fresh
`python -m ddp_helpers.engines.local.supervisor SPEC_FILE`) or warm (forked by the zygote, which has torch imported:
`warm.py`). The supervisor runs torchrun's agent (a c10d rendezvous on a store it hosts on loopback and a
port the OS picks, so launches never collide and nothing listens beyond this machine) with the caller's
own interpreter, so the ranks see the same packages as the notebook. Each rank runs the script through
`ddp_helpers._bootstrap`.

Failure handling:
- A rank raises or is killed: torchrun stops the other ranks; the result names the rank that failed
  first and carries its Python traceback, or the signal that killed it.
- The run exceeds its timeout: every live rank says what it waits in, then dumps its stack (SIGUSR1,
  faulthandler); once the dumps are written (at most STACK_DUMP_WAIT_S) the run is stopped.
- Stopping takes at most SHUTDOWN_GRACE_S for the ranks to end on SIGTERM, then everything is killed:
  every process of a run is gone within STOP_BOUND_S of the stop.
- The kernel is killed outright: the supervisor (which outlives it) stops the run and sweeps.
Whatever the ending, any process still carrying the run's marker is killed.

Network: gloo and nccl sockets are kept on loopback (GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo);
torchrun's rendezvous store (a TCPStore in the supervisor) is bound to loopback too.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ... import hang
from ...python_command import python_module_command
from ...processes import kill_marked, kill_process_groups, process_is_dead, run_despite_interrupts, stop_process_group
from ...run_folder import (LOOPBACK_ENV, RUN_DIR_ENV, RUN_ID_ENV, AgentOutcome, KillRequest, RankIdentity, RunFolder,
                           open_private)
from ...text_in_file import TextInFile
from .. import Ending, Engine, LaunchConfig, OutputPump, RankEnding, rank_command
from . import warm
from ._framing import ForkRequest
from .supervisor_spec import SupervisorSpec
from .warm import WarmProcess, WarmRefused, current_umask, warm_zygote, what_happened_to_the_warm_process

_STUB = str(Path(__file__).resolve().parent / "_zygote_stub.py")
# Variables that differ from launch to launch: not part of the warm process's environment.
RUN_ENV_KEYS = (RUN_DIR_ENV, RUN_ID_ENV)
# Every rank of a run here is on this machine: gloo's and nccl's sockets, and the stores, on loopback only.
RANK_HOOK = "ddp_helpers.engines.local.rank_hook"  # its ranks' side: kill-after and the loopback store
ON_THIS_MACHINE = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", LOOPBACK_ENV: "1"}

# The ranks get this long to end after SIGTERM (torchrun's --shutdown-timeout), then SIGKILL.
SHUTDOWN_GRACE_S = 3
# The supervisor gets this long on top to stop the agent and sweep, then it is killed too.
_SUPERVISOR_EXTRA_S = 4
# Every process of a stopped run is gone within this bound (stated in the README; a test holds it).
STOP_BOUND_S = 15
STACK_DUMP_WAIT_S = 5.0
HANG_REPORT_WAIT_S = hang.ANSWER_WAIT_S
_WAIT_STEP_S = 0.05


def child_environment(config: LaunchConfig, run_id: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the supervisor and the ranks get: the rank contract (`engines.rank_command`) on top
    of the caller's environment, with every socket and store of the run on loopback."""
    return rank_command(config, run_id, ON_THIS_MACHINE, hooks=(RANK_HOOK,)).environment(base)


def agent_gpus(config: LaunchConfig, env: dict[str, str]) -> tuple[str, ...] | None:
    """With nccl and several agents, each agent stands for a machine with its own GPUs: agent k gets the
    k-th `ranks_per_agent` of them (as CUDA_VISIBLE_DEVICES)."""
    if config.nnodes == 1 or config.backend != "nccl":
        return None
    visible = (env.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(config.world_size)))).split(",")
    per_agent = config.ranks_per_agent
    return tuple(",".join(visible[k * per_agent:(k + 1) * per_agent]) for k in range(config.nnodes))


def supervisor_spec(config: LaunchConfig, folder: RunFolder, run_id: str, parent_pid: int, env: dict[str, str],
                    zygote_socket: str | None = None) -> SupervisorSpec:
    """The supervisor's spec for `config`. With a zygote, torchrun starts each worker through `_zygote_stub`
    (no torch import), which has the zygote fork it."""
    worker = list(rank_command(config, run_id).argv)
    if zygote_socket is not None:
        worker = [sys.executable, "-S", "-u", _STUB, zygote_socket, *worker]
    else:
        worker = [sys.executable, "-u", *worker]
    worker = ["--no-python", *worker]  # the interpreter's own flags (-P) are ours to give, not torchrun's
    return SupervisorSpec(
        parent_pid=parent_pid, run_id=run_id, shutdown_grace_s=SHUTDOWN_GRACE_S, nnodes=config.nnodes,
        ranks_per_agent=config.ranks_per_agent, max_restarts=config.max_restarts, worker=tuple(worker),
        log_dir=str(folder.torchrun_log_dir), join_after=config.job.join_after, agent_gpus=agent_gpus(config, env),
    )


class LocalEngine(Engine):
    """torchrun agents on this machine, cold or warm, one or several (`config.nnodes`)."""

    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self.config, self.folder = config, folder
        self.run_id = ""
        self.process: subprocess.Popen | WarmProcess | None = None
        self._log = None
        self._killer = RankKiller(config, folder) if config.job.kill_rank is not None else None
        self._supervisor_pidfd: int | None = None  # a cold supervisor's, once waited on

    def start(self, run_id: str) -> None:
        self.run_id = run_id
        self._log = open_private(self.folder.torchrun_log, "wb")
        job = self.config.job
        if job.kill_rank is not None:  # read by the rank itself (_bootstrap): see RankKiller
            self.folder.write_kill_request(KillRequest(rank=job.kill_rank, text=job.kill_after))
        self.process = self._start_supervisor(child_environment(self.config, run_id))

    def _start_supervisor(self, env: dict[str, str]) -> subprocess.Popen | WarmProcess:
        """Fork the supervisor from the zygote when the launch can be warm; else start a fresh interpreter."""
        config, folder = self.config, self.folder
        zygote = None
        if config.job.warm:
            without_cell_env = child_environment(dataclasses.replace(config, extra_env={}), self.run_id)
            zygote = warm_zygote(env, RUN_ENV_KEYS, without_cell_env)
        if zygote is not None:
            supervisor_spec(config, folder, self.run_id, zygote.process.pid, env, zygote.socket_path).write(
                folder.supervisor_spec)
            request = ForkRequest("supervisor", [str(folder.supervisor_spec)], env, str(config.working_dir),
                                  current_umask())
            with open(os.devnull, "rb") as devnull:
                try:
                    return WarmProcess.start(zygote.socket_path, request,
                                             (devnull.fileno(), self._log.fileno(), self._log.fileno()))
                except (OSError, ValueError) as error:  # ValueError: a garbled answer
                    if isinstance(error, WarmRefused) and error.replace:
                        zygote.note(f"{error}; it is started again for the next launch")
                        zygote.replace()
                    else:
                        zygote.note(f"the warm process could not start the run ({error})")
        supervisor_spec(config, folder, self.run_id, os.getpid(), env).write(folder.supervisor_spec)
        return subprocess.Popen(
            python_module_command("ddp_helpers.engines.local.supervisor", str(folder.supervisor_spec)),
            env=env,
            cwd=config.working_dir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the stop button's SIGINT reaches only the kernel
        )

    def running(self) -> bool:
        if self._killer is not None:
            self._killer.poll()
        return self.process.poll() is None

    def wait_for_end(self, seconds: float) -> None:
        """Until the supervisor ends (the zygote's word, or a cold one's pidfd), at most `seconds`: the launch
        returns as soon as the run ended, not at the next poll."""
        ended = self._ended_fd()
        if ended is None:
            time.sleep(seconds)
            return
        waiter = select.poll()  # not select(): a kernel may hold descriptors numbered past 1024
        waiter.register(ended, select.POLLIN)
        waiter.poll(seconds * 1000)

    def _ended_fd(self) -> int | None:
        if isinstance(self.process, WarmProcess):
            return self.process.ended_fd()
        if self._supervisor_pidfd is None and self.process is not None and self.process.returncode is None:
            try:
                self._supervisor_pidfd = os.pidfd_open(self.process.pid)  # readable once it exited, reaped or not
            except (AttributeError, OSError):  # reaped already, or no pidfds in this Python or kernel
                return None
        return self._supervisor_pidfd

    ranks_asked = "live rank"
    answer_wait_s = HANG_REPORT_WAIT_S

    def ranks_to_ask(self) -> list[int]:
        return live_ranks(self.config, self.folder)

    def on_timeout(self, output: OutputPump, why: str = "timed out") -> None:
        """As every engine (each live rank's thread writes its stacks, then what it waits in: `_hang_probe`),
        then SIGUSR1 (faulthandler's dump) for a rank whose thread did not answer: the signal is the script's to
        own. The wait goes on until each such dump is written (it stops growing), at most STACK_DUMP_WAIT_S."""
        super().on_timeout(output, why)
        signal_the_silent_ranks(self.config, self.folder, output)

    def stop(self) -> None:
        """Bounded by STOP_BOUND_S; pressing stop again meanwhile does not cut it short."""
        run_despite_interrupts(self._stop_supervisor, self._sweep)

    def _stop_supervisor(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, grace_s=SHUTDOWN_GRACE_S + _SUPERVISOR_EXTRA_S)

    def _sweep(self) -> None:
        kill_marked(self.run_id, RUN_ID_ENV, recorded=self.folder.read_forked_children())
        kill_process_groups(self.folder.rank_pids(self.config.world_size))
        if self._log is not None:
            self._log.close()
        pidfd, self._supervisor_pidfd = self._supervisor_pidfd, None  # safe to repeat (a second stop press)
        if pidfd is not None:
            os.close(pidfd)

    def ending(self) -> Ending:
        if self._killer is not None:
            self._killer.say_if_never_killed()
        process = self.process
        returncode = process.returncode if process is not None else None
        if isinstance(process, WarmProcess):
            note = what_happened_to_the_warm_process(process)
            if note:
                print(f"[ddp_helpers] {note}", file=sys.stderr, flush=True)
            if process.unreported:  # the supervisor's exit code was lost with the warm process: it is its outcome's
                returncode = None
        outcome = self.folder.read_outcome()  # None: the supervisor was killed before it could write it
        succeeded = returncode == 0 if returncode is not None else outcome is not None and outcome.succeeded
        nnodes = self.config.nnodes
        return Ending(ranks=rank_endings(self.config, self.folder, outcome), succeeded=succeeded,
                      where=f"on {nnodes} agents" if nnodes > 1 else "",
                      launcher_log=self.folder.read_text(self.folder.torchrun_log))


def rank_endings(config: LaunchConfig, folder: RunFolder, outcome: AgentOutcome | None) -> tuple[RankEnding, ...]:
    """How each rank ended: as its torchrun agent saw it (the supervisor's `outcome`: its per-rank failures,
    negative for a signal), else as the rank wrote it as it ended, else unknown (None). An elastic run has
    as many ranks as its world grew to (agents that never joined left none)."""
    # A rank that never started wrote no identity: its world size is unknown.
    identities = [folder.read_identity(rank) for rank in range(config.world_size)]
    world_size = config.world_size
    if config.job.join_after:
        world_size = max([identity.world_size for identity in identities if identity] + [config.ranks_per_agent])
    if outcome is None:  # no agent to ask: how each rank said it ended, if it could
        return tuple(RankEnding(folder.read_exit_code(rank)) for rank in range(world_size))
    return tuple(RankEnding(_exit_code(folder, rank, identities[rank], outcome), outcome.died_at.get(rank))
                 for rank in range(world_size))


def _exit_code(folder: RunFolder, rank: int, identity: RankIdentity | None, outcome: AgentOutcome) -> int | None:
    """How `rank` ended: as its agent saw it (`outcome`), else as the rank wrote it, else unknown (None)."""
    if outcome.succeeded:
        return 0
    if outcome.failures is None:
        return None  # no agent could say
    if rank in outcome.failures:
        return outcome.failures[rank]
    if identity is not None and identity.agent in outcome.unfinished_agents:
        # Its agent was stopped before it could say: finished if the rank wrote how it ended, else stopped.
        return folder.read_exit_code(rank)
    return 0  # the agent listed every rank that failed; this one was not among them


class RankKiller:
    """SIGKILLs `config.job.kill_rank` once, as soon as its first attempt has printed `config.job.kill_after`, and
    says so. The rank kills itself first, at the end of that line (`_bootstrap`, from the folder's
    kill_request): watching its output from here comes later, by then the rank may be a step further
    (a step whose all-reduce its peers finished but which it never reported), and a demo that kills
    "after step 5" would not be the same run twice."""

    def __init__(self, config: LaunchConfig, folder: RunFolder):
        self._rank, self._text, self._folder = config.job.kill_rank, config.job.kill_after, folder
        # Both streams, whatever wrote to them: print, logging (stderr), sys.stdout.buffer, a subprocess.
        self._printed = [TextInFile(folder.output(self._rank, stream), self._text)
                         for stream in ("stdout", "stderr")]
        self.done = False

    def poll(self) -> None:
        if self.done or not any([watch.seen() for watch in self._printed]):
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

    def say_if_never_killed(self) -> None:
        """At the end of the run: a --kill-after whose text never came killed nobody, and the run's success
        would otherwise read as a restart that worked."""
        self.poll()
        if not self.done:
            print(f"[ddp_helpers] rank {self._rank} never printed {self._text!r} (on stdout or stderr), so no rank was "
                  "killed (--kill-after).", file=sys.stderr, flush=True)


def live_ranks(config: LaunchConfig, folder: RunFolder) -> list[int]:
    return [rank for rank in range(config.world_size)
            if (pid := folder.rank_pid(rank)) is not None and not process_is_dead(pid)]


def signal_the_silent_ranks(config: LaunchConfig, folder: RunFolder, streamer: OutputPump) -> None:
    """After the hang report's question: SIGUSR1 to each live rank that neither answered nor wrote a stack, and
    a wait, at most STACK_DUMP_WAIT_S, until each such dump is written (it stops growing)."""
    live = live_ranks(config, folder)
    if live and all(folder.hang_answered(rank) for rank in live):
        time.sleep(_WAIT_STEP_S)  # the thread is back, blocked on its pipe
    asked = []
    for rank in (rank for rank in live if not folder.hang_answered(rank) and _size(folder.stack_file(rank)) == 0):
        try:
            os.kill(folder.rank_pid(rank), signal.SIGUSR1)
            asked.append(rank)
        except (ProcessLookupError, PermissionError):
            pass
    sizes: dict[int, int] = {}
    until = time.monotonic() + STACK_DUMP_WAIT_S
    while asked and time.monotonic() < until:
        streamer.poll()
        time.sleep(_WAIT_STEP_S)
        now = {rank: _size(folder.stack_file(rank)) for rank in asked}
        if all(size > 0 and sizes.get(rank) == size for rank, size in now.items()):
            break  # every dump written, none still growing
        sizes = now


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def prepare_warm_launches(timeout_s: float | None = 60) -> bool:
    """Start the warm process now and wait until it is ready (otherwise the first launch of a process
    starts it and waits for it). Returns True when it is ready. `timeout_s=None`: start it in the
    background and return at once (`%load_ext ddp_helpers` does, so that it is ready by the first cell)."""
    defaults = LaunchConfig(Path(__file__), 1, "gloo", 1.0, Path(os.sep))  # the run's own values left out
    return warm.prepare_warm_launches(child_environment(defaults, ""), RUN_ENV_KEYS, timeout_s)
