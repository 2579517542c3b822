"""The torchrun agents of a run, as the supervisor (`supervisor.py`) runs them: the first in the
supervisor's own process (`run_torchrun`), the others (`--nnodes N`, each standing for a machine) in
processes forked from it (`OtherAgents`), all meeting through a c10d rendezvous on a store the
supervisor hosts. An agent that fails stops the run at once; with `join_after` (elastic membership) the
others start only once rank 0 has printed a given text (`JoinWhenSeen`). Each further agent writes
its own outcome (`RunFolder.write_outcome(outcome, agent)`); `merge_outcomes` makes one outcome of them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from ...text_in_file import TextInFile
from ...processes import ARM_PARENT_DEATH_FAILED, arm_parent_death_signal
from ...run_folder import AGENT_ENV, AGENT_PID_ENV, AgentOutcome, RunFolder
from .supervisor_spec import SupervisorSpec
from .torchrun_waits import without_idle_waits

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """SIGTERM/SIGINT/SIGHUP before or after the agent's own handlers were in place."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def raise_stopped(signum, frame):
    raise Stopped(signum)


def run_torchrun(argv: list[str]) -> AgentOutcome:
    """Run the torchrun agent here; return what it observed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
        return AgentOutcome(succeeded=True)
    except ChildFailedError as failed:
        return AgentOutcome(succeeded=False,
                            failures={int(rank): int(f.exitcode) for rank, f in failed.failures.items()})
    except SignalException as stopped:
        return AgentOutcome(succeeded=False, stopped_by=signal.Signals(stopped.sigval).name)


def run_agent(agent: int, spec: SupervisorSpec, torchrun_argv: list[str]) -> AgentOutcome:
    """Agent `agent` of the run, in this process (agent 0 in the supervisor, the others in its forks): what it
    observed. A stop signal, or the agent's own failure, is its outcome too."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ[AGENT_ENV] = str(agent)
    if spec.agent_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.agent_gpus[agent]
    try:
        without_idle_waits()
        return run_torchrun(torchrun_argv)
    except Stopped as stopped:
        return AgentOutcome(succeeded=False, stopped_by=str(stopped))
    except BaseException as error:  # noqa: BLE001 - the agent itself failed: say so
        traceback.print_exc()
        return AgentOutcome(succeeded=False, agent_error=f"{type(error).__name__}: {error}")


class OtherAgents:
    """Agents 1 .. N-1, forked from this process before it starts any thread (cheap: a warm supervisor
    has torch imported already), each in a session of its own. They wait for their torchrun arguments
    (which name the rendezvous store, made after the fork) on a pipe."""

    def __init__(self, folder: RunFolder, spec: SupervisorSpec):
        self._folder = folder
        self.pids: list[int] = []
        self._argument_pipes: list[int] = []
        self.exit_codes: dict[int, int] = {}
        self._starting = threading.Lock()
        parent = os.getpid()
        for agent in range(1, spec.nnodes):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                for other_write_end in (write_end, *self._argument_pipes):  # else an earlier agent's pipe never ends
                    os.close(other_write_end)
                code = 1
                try:
                    os.setsid()
                    code = _run_other_agent(agent, parent, read_end, folder, spec)
                finally:
                    os._exit(code)
            os.close(read_end)
            self.pids.append(pid)
            self._argument_pipes.append(write_end)
        self.stopping = False
        self.started = False  # given their arguments: with join_after, only once rank 0 printed the text
        self.rendezvous_store = None  # the TCPStore every agent meets at, hosted here
        for pid in self.pids:
            threading.Thread(target=self._reap, args=(pid,), name="ddp_helpers-agent", daemon=True).start()

    def _reap(self, pid: int) -> None:
        """Notes the agent's exit. One that failed while the run goes on stops the run: as `srun
        --kill-on-bad-exit` does on a cluster, or agent 0 would wait for it at torchrun's exit barrier
        (5 minutes) after its own ranks finished."""
        _, status = os.waitpid(pid, 0)
        self.exit_codes[pid] = os.waitstatus_to_exitcode(status)
        if self.exit_codes[pid] != 0 and not self.stopping:
            os.kill(os.getpid(), signal.SIGTERM)
            # Agent 0 may already wait at the exit barrier, in C++, where no signal handler runs: with the
            # store closed, the wait fails at once.
            self.rendezvous_store = None

    def start(self, torchrun_argv: list[str]) -> None:
        with self._starting:  # the join thread and the final wait may both get here
            self.started = self.started or bool(self._argument_pipes and torchrun_argv)
            for write_end in self._argument_pipes:
                os.write(write_end, json.dumps(torchrun_argv).encode())
                os.close(write_end)
            self._argument_pipes = []

    def wait(self, timeout_s: float, grace_s: float) -> None:
        """Wait for every agent to end; SIGTERM those still running after `timeout_s` (each then stops its
        ranks), and SIGKILL those still running `grace_s` later."""
        self.stopping = True
        self.start([])  # agents never given arguments (this process is stopping) exit at once
        for sig, wait in ((None, timeout_s), (signal.SIGTERM, grace_s + 1), (signal.SIGKILL, 5.0)):
            alive = [pid for pid in self.pids if pid not in self.exit_codes]
            for pid in alive:
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            until = time.monotonic() + wait
            while any(pid not in self.exit_codes for pid in alive) and time.monotonic() < until:
                time.sleep(0.05)

    def outcomes(self) -> list[AgentOutcome]:
        """Each started agent's outcome (none when they never joined: the run went on without them)."""
        if not self.started:
            return []
        return [self._folder.read_outcome(agent)
                or AgentOutcome(succeeded=False, agent_error=f"agent {agent} ended without a word (exit code "
                                                              f"{self.exit_codes.get(pid)})")
                for agent, pid in enumerate(self.pids, start=1)]


class JoinWhenSeen:
    """Elastic membership: calls `join` once rank 0's output contains `text` (checked every 0.1 s)."""

    def __init__(self, folder: RunFolder, text: str, join):
        self._printed, self._text, self._join = TextInFile(folder.output(0, "stdout"), text), text, join
        threading.Thread(target=self._watch, name="ddp_helpers-join", daemon=True).start()

    def _watch(self) -> None:
        while not self._printed.seen():
            time.sleep(0.1)
        print(f"[ddp_helpers] rank 0 printed {self._text!r}: the other agents start and join", flush=True)
        self._join()


def merge_outcomes(outcomes: list[AgentOutcome]) -> AgentOutcome:
    """One outcome for the run from every agent's (`outcomes[k]` is agent k's)."""
    failures = None
    unfinished: tuple[int, ...] = ()
    if any(o.failures is not None for o in outcomes):
        failures = {rank: code for o in outcomes for rank, code in (o.failures or {}).items()}
        # Agents stopped (or broken) before their torchrun could say how their ranks ended: those ranks are
        # not among the failures, and not known to have finished either.
        unfinished = tuple(agent for agent, o in enumerate(outcomes) if not o.succeeded and o.failures is None)
    return AgentOutcome(
        succeeded=all(o.succeeded for o in outcomes), failures=failures, unfinished_agents=unfinished,
        stopped_by=next((o.stopped_by for o in outcomes if o.stopped_by), ""),
        agent_error=next((o.agent_error for o in outcomes if o.agent_error), ""))


def _run_other_agent(agent: int, parent_pid: int, argument_pipe: int, folder: RunFolder,
                     spec: SupervisorSpec) -> int:
    """In a forked child: agent `agent` of the run. Its parent (agent 0's supervisor) sweeps at the end."""
    if arm_parent_death_signal(signal.SIGTERM, parent_pid) == ARM_PARENT_DEATH_FAILED:
        return 1
    with os.fdopen(argument_pipe, "rb") as pipe:
        torchrun_argv = json.loads(pipe.read() or b"[]")
    if not torchrun_argv:
        return 1  # the supervisor stopped before the rendezvous was set up
    outcome = run_agent(agent, spec, torchrun_argv)
    folder.write_outcome(outcome, agent)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if outcome.succeeded else 1
