"""The process between the notebook's kernel and the ranks:

    python -m ddp_helpers.engines.local.supervisor SPEC_FILE

(the spec, a `SupervisorSpec`, is written into the run folder by the local engine, `engine.py`).

It runs the torchrun agent in this very process (so the agent's own per-rank failures, exit codes
included, are read as objects, not parsed from its printed summary), and around it:
- caps each rank's output: ranks write into named pipes, a thread keeps the first and last
  `OUTPUT_KEEP_BYTES` of each stream in its output file (a rank printing forever costs neither
  memory nor disk);
- watches when each rank dies (so the rank that failed first is known even when a signal killed it);
- however the launch ends (success, a failed rank, SIGTERM from the launcher, the kernel's death),
  stops every process of the run before it exits: the agent stops the workers (SIGTERM, then SIGKILL
  after SHUTDOWN_GRACE_S), then every process still carrying the run's marker is killed (a rank's own
  children: DataLoader workers, subprocesses); then it writes the run's outcome (`RunFolder.write_outcome`).

Several agents (`--nnodes N`, each standing for a machine, all on loopback): this process hosts the
rendezvous store (a TCPStore on loopback, on a port the OS picks; the rendezvous state in it is signed with
a key only this process and its forks hold, `store_guard`), forks agents 1 .. N-1 (each dies with this one,
and writes its own outcome), runs agent 0 itself, and they meet through
torchrun's c10d rendezvous on that store. Output pipes, death watch and the final sweep cover every
rank of the world. Each rank learns its agent from DDP_HELPERS_AGENT (and, on GPUs, each agent gets its
own GPUs: the spec's `agent_gpus`).

It outlives the kernel on purpose: when the kernel dies (even by SIGKILL) it gets SIGTERM (the
parent-death signal) and cleans up. It lives in its own session, so the notebook's stop button
(SIGINT to the kernel's process group) reaches only the kernel, which then stops the run through it.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import sys
import threading
import time
import traceback

from dataclasses import replace
from pathlib import Path

from .agents import STOP_SIGNALS, JoinWhenSeen, OtherAgents, Stopped, merge_outcomes, raise_stopped, run_agent
from ...processes import (
    ARM_PARENT_DEATH_FAILED, arm_parent_death_signal, become_child_subreaper, kill_descendants, kill_marked,
    kill_process_groups, process_is_dead,
)
from ...run_folder import OUTPUT_KEEP_BYTES, RUN_ID_ENV, AgentOutcome, RunFolder, open_private
from ...store_guard import keep_stores_on_loopback, loopback_store, sign_rendezvous_state
from .supervisor_spec import SupervisorSpec


class CappedOutput:
    """One rank's stream in a file: the first `keep` bytes as they come, the last `keep` at the end."""

    def __init__(self, path, keep: int = OUTPUT_KEEP_BYTES):
        self.file = open_private(path, "ab")
        self.keep = keep
        self.head_left = keep
        self.tail = bytearray()
        self.dropped = 0

    def write(self, data: bytes) -> None:
        if self.head_left > 0:
            head = data[: self.head_left]
            self.file.write(head)
            self.file.flush()
            self.head_left -= len(head)
            data = data[len(head):]
        if data:
            self.tail += data
            excess = len(self.tail) - self.keep
            if excess > 0:
                del self.tail[:excess]
                self.dropped += excess

    def close(self) -> None:
        if self.dropped:
            cut = self.tail.find(b"\n") + 1  # start the kept end at a line boundary
            self.dropped += cut
            del self.tail[:cut]
            self.file.write(
                f"\n[ddp_helpers] ... {self.dropped:,} bytes of output dropped here (kept: the first and the "
                f"last {self.keep // 1024:,} KiB) ...\n".encode()
            )
        self.file.write(self.tail)
        self.file.close()


class OutputPipes:
    """Named pipes the ranks write into, drained by one thread into capped files."""

    def __init__(self, folder: RunFolder, world_size: int):
        folder.pipes_dir.mkdir(mode=0o700, exist_ok=True)
        self._selector = selectors.DefaultSelector()
        self._keepers: list[int] = []
        self._outputs: dict[int, CappedOutput] = {}
        for rank in range(world_size):
            for kind in ("stdout", "stderr"):
                fifo = folder.fifo(rank, kind)
                os.mkfifo(fifo, 0o600)
                read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
                # Held open for writing here too: the pipe never reads as ended before a rank opens it.
                self._keepers.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                self._outputs[read_fd] = CappedOutput(folder.output(rank, kind))
                self._selector.register(read_fd, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._wake, self._waker = os.pipe()  # a byte from close() ends the thread's wait at once
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._drain, name="ddp_helpers-output", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                if key.fd != self._wake:
                    self._read(key.fd)
        for fd in self._outputs:  # what is left after the ranks ended
            while self._read(fd):
                pass

    def _read(self, fd: int) -> bool:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if data:
            self._outputs[fd].write(data)
        return bool(data)

    def close(self) -> None:
        self._stop.set()
        os.write(self._waker, b".")
        self._thread.join()
        os.close(self._wake)
        os.close(self._waker)
        for fd, output in self._outputs.items():
            output.close()
            os.close(fd)
        for fd in self._keepers:
            os.close(fd)


class DeathWatcher:
    """Notes the time each rank's process is first seen dead (exited or killed), every 20 ms."""

    def __init__(self, folder: RunFolder, world_size: int):
        self._folder = folder
        self._world_size = world_size
        self.died_at: dict[int, float] = {}
        self._pids: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddp_helpers-deaths", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.look()

    def look(self) -> None:
        now = time.time()
        for rank in range(self._world_size):
            known = self._pids.get(rank)
            if known is not None and not process_is_dead(known):
                continue  # running: nothing to read
            pid = self._folder.rank_pid(rank)  # not started yet, or ended: a new attempt may have started
            if pid is None:
                continue
            if pid != known:  # a new attempt (after a restart): its death is what counts
                self._pids[rank] = pid
                self.died_at.pop(rank, None)
                if not process_is_dead(pid):
                    continue
            self.died_at.setdefault(rank, now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.look()


class SupervisedRun:
    """One launch as the supervisor runs it: agent 0 here, the others forked; whatever happens, the sweep."""

    def __init__(self, spec: SupervisorSpec, folder: RunFolder):
        self.spec, self.folder = spec, folder
        self.pipes: OutputPipes | None = None
        self.watcher: DeathWatcher | None = None
        self.others: OtherAgents | None = None
        self._own_store = None

    def run(self) -> AgentOutcome:
        """Run the launch to its end, stop everything of it, write its outcome; return the outcome."""
        outcome = AgentOutcome(succeeded=False)
        try:
            outcome = self._run_agents()
        except Stopped as stopped:
            outcome = AgentOutcome(succeeded=False, stopped_by=str(stopped))
            if self.others is not None:  # stopped because another agent failed: its outcome tells which rank
                self.others.wait(timeout_s=0, grace_s=self.spec.shutdown_grace_s)
                outcome = merge_outcomes([outcome, *self.others.outcomes()])
        except BaseException as error:  # noqa: BLE001 - the supervisor itself failed: say so, still clean up
            traceback.print_exc()
            outcome = AgentOutcome(succeeded=False, agent_error=f"{type(error).__name__}: {error}")
        finally:
            for signum in STOP_SIGNALS:  # cleanup is not to be interrupted; the launcher's last resort is SIGKILL
                signal.signal(signum, signal.SIG_IGN)
            outcome = self._sweep(outcome)
        return outcome

    def _run_agents(self) -> AgentOutcome:
        spec = self.spec
        if spec.nnodes > 1:
            self.others = OtherAgents(self.folder, spec)  # forked first, while this process has a single thread
        self.pipes = OutputPipes(self.folder, spec.world_size)
        self.watcher = DeathWatcher(self.folder, spec.world_size)
        # The rendezvous store, hosted here for every agent: its port is chosen by the OS, so launches never
        # collide, and it is bound to loopback (torchrun's --standalone store listens on every interface).
        store = loopback_store()
        torchrun_argv = spec.torchrun_argv(store.port)
        if self.others is None:
            self._own_store = store  # kept open for the run
        else:
            self.others.rendezvous_store = store  # the only reference: closed when an agent fails (OtherAgents._reap)
            if spec.join_after:
                JoinWhenSeen(self.folder, spec.join_after, lambda: self.others.start(torchrun_argv))
            else:
                self.others.start(torchrun_argv)
        del store
        outcome = run_agent(0, spec, torchrun_argv)
        if self.others is not None:
            # Agent 0 failed: the others would wait for it at the exit barrier. Else they are ending too.
            self.others.wait(timeout_s=spec.shutdown_grace_s + 2 if outcome.succeeded else 0,
                             grace_s=spec.shutdown_grace_s)
            outcome = merge_outcomes([outcome, *self.others.outcomes()])
        return outcome

    def _sweep(self, outcome: AgentOutcome) -> AgentOutcome:
        """Stop every process of the run, close the pipes, and write the outcome (with when each rank
        died); return it."""
        folder, world_size = self.folder, self.spec.world_size
        if self.others is not None:
            self.others.wait(timeout_s=0, grace_s=self.spec.shutdown_grace_s)  # they stop their ranks, then we sweep
        kill_marked(self.spec.run_id, RUN_ID_ENV, recorded=folder.read_forked_children())
        kill_process_groups(folder.rank_pids(world_size))
        kill_descendants()  # what a rank left orphaned came to us (a child subreaper), marked or not
        if self.watcher is not None:
            self.watcher.stop()
            outcome = replace(outcome, died_at=dict(self.watcher.died_at))
        if self.pipes is not None:
            self.pipes.close()
        if self.others is not None:
            self.others.rendezvous_store = None
        self._own_store = None
        shutil.rmtree(folder.pipes_dir, ignore_errors=True)
        shutil.rmtree(self.spec.log_dir, ignore_errors=True)
        folder.remove_empty_stack_files(world_size)  # asked for no stack: no empty file to puzzle over
        folder.write_outcome(outcome)
        sys.stdout.flush()
        sys.stderr.flush()
        return outcome


def main(argv: list[str]) -> int:
    for signum in STOP_SIGNALS:
        signal.signal(signum, raise_stopped)
    if len(argv) != 1:
        print("usage: python -m ddp_helpers.engines.local.supervisor SPEC_FILE (a supervisor spec in a run folder)",
              file=sys.stderr)
        return 2
    spec = SupervisorSpec.read(argv[0])
    # The kernel's death reaches us as SIGTERM: we stop the run, then exit.
    if arm_parent_death_signal(signal.SIGTERM, spec.parent_pid) == ARM_PARENT_DEATH_FAILED:
        return 1  # the kernel died before we were ready: nothing was started
    become_child_subreaper()  # a cold rank killed outright leaves its children to us, not to init
    # Before the other agents are forked: theirs too, and they share the key.
    keep_stores_on_loopback()
    sign_rendezvous_state(secrets.token_bytes(32))
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(spec.shutdown_grace_s))
    outcome = SupervisedRun(spec, RunFolder(Path(argv[0]).parent, spec.run_id)).run()
    return 0 if outcome.succeeded else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
