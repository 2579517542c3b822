"""What a launch hands back: `RunResult`, with one `RankResult` per rank, and `RunFailed`."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .hang import HangReport
from .run_folder import ATTEMPT_MARK

if TYPE_CHECKING:  # annotations only
    from .engines import LaunchConfig


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RankError:
    """The exception that ended a rank, as the rank itself reported it."""

    type: str
    message: str
    traceback: str
    time: float


# Above a timed-out rank's stack dump, in its stderr.
STACK_HEADING = "[ddp_helpers] where rank {rank} was when the run timed out:"


@dataclass(frozen=True)
class RankResult:
    """One rank's part of a run.

    Attributes:
        rank: the global rank.
        exit_code: the status the OS saw when the rank's process ended (as the torchrun agent observed
            it): 0 ok, 1-255 the script's exit code, minus the signal number for a rank killed by a
            signal; None when unknown (the launcher's timeout or interrupt stopped the run).
        stdout, stderr: what the rank printed, not interleaved with other ranks (capped: the first and
            last MiB of each, with a line saying how much was dropped).
        facts: the values it recorded with `ddp_helpers.record`, by name.
        error: the exception that ended it, if any.
        ended_at: when it failed (its exception's time, or when it was seen to die), if it failed.
        unreadable_facts: {name: why} for recorded values that could not be read back.
        root_cause: this rank failed first; the others were stopped because of it.
        agent: which of the run's torchrun agents started it (0 .. nnodes - 1; None if it never started).
        group_rank, local_rank: its agent's place in the rendezvous (GROUP_RANK), and its LOCAL_RANK there.
        restart: the restart count (TORCHELASTIC_RESTART_COUNT) of its latest attempt: 0 if never restarted.
        node: the machine it ran on (its name as the engine gave it, or the host's name).
            `attempts` splits its stdout by attempt.
    """

    rank: int
    exit_code: int | None
    stdout: str
    stderr: str
    facts: dict = field(default_factory=dict)
    error: RankError | None = None
    ended_at: float | None = None
    unreadable_facts: dict = field(default_factory=dict)
    root_cause: bool = False
    agent: int | None = None
    group_rank: int | None = None
    local_rank: int | None = None
    restart: int = 0
    node: str | None = None

    @property
    def attempts(self) -> list[str]:
        """Its stdout, one string per attempt (after a restart the rank's output goes on in the same file,
        from a line starting with ATTEMPT_MARK)."""
        parts = re.split(rf"^{re.escape(ATTEMPT_MARK)} .*\n", self.stdout, flags=re.M)
        return parts

    @property
    def status(self) -> str:
        if self.exit_code == 0:
            return "ok"
        if self.exit_code is None:
            return "stopped"
        if self.exit_code < 0:
            name = _signal_name(-self.exit_code)
            if self.root_cause:
                return f"killed by {name}" + _SIGNAL_HINTS.get(name, "")
            return f"stopped ({name})"
        return f"failed (exit code {self.exit_code})"

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.exit_code is not None and self.exit_code != 0)


# What a signal that killed a rank on its own usually means.
_SIGNAL_HINTS = {
    "SIGKILL": ": out of memory? (the kernel's OOM killer sends SIGKILL)",
    "SIGSEGV": ": a crash in native code",
    "SIGABRT": ": aborted in native code",
    "SIGBUS": ": a crash in native code",
}


# A rank's error that only says a peer went away: its time is when it noticed, which can come before the
# supervisor (polling every 20 ms) saw the peer die.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")
_PEER_NOTICED_WITHIN_S = 1.0


def find_root_cause(ranks) -> "RankResult | None":
    """The rank that failed first: the earliest time a failed rank ended (its exception's time, or when
    the supervisor saw it die); a rank with a Python error or a positive exit code wins a tie. A rank
    whose error only says that a peer went away yields to a rank killed by a signal around that time."""
    failed = [r for r in ranks if r.failed]
    if not failed:
        return None

    def ended_at(r: RankResult) -> float:
        if r.ended_at is not None:
            return r.ended_at
        return r.error.time if r.error is not None else float("inf")

    first = min(
        failed,
        key=lambda r: (
            ended_at(r),
            0 if (r.error is not None or (r.exit_code or 0) > 0) else 1,
            r.rank,
        ),
    )
    if first.error is None and first.exit_code == -signal.SIGTERM:
        # SIGTERM is how torchrun stops the other ranks once one failed: under load the supervisor can see a
        # SIGTERMed rank end in the same look as the rank that failed, or first. It yields to that rank.
        other = [r for r in failed if (r.error is not None or r.exit_code != -signal.SIGTERM)
                 and ended_at(r) - ended_at(first) <= _PEER_NOTICED_WITHIN_S]
        if other:
            first = min(other, key=lambda r: (ended_at(r), r.rank))
    if first.error is not None and any(text in first.error.message for text in _PEER_GONE):
        killed = [r for r in failed if r.error is None and (r.exit_code or 0) < 0 and r.exit_code != -signal.SIGTERM
                  and ended_at(r) - ended_at(first) <= _PEER_NOTICED_WITHIN_S]
        if killed:
            return min(killed, key=lambda r: (ended_at(r), r.rank))
    return first


@dataclass(frozen=True)
class RunResult:
    """A finished launch.

    Attributes:
        config: the LaunchConfig that was run.
        ranks: one RankResult per rank, indexed by rank: `run.ranks[1].facts["indices"]`.
        wall_time_s: seconds from launch to the end of cleanup.
        backend: "gloo" or "nccl".
        devices: the device each rank was given ("cpu", or "cuda:k" with k its LOCAL_RANK: its machine's GPU k).
        job_succeeded: whether the engine saw the whole run end well (torchrun's agents, a job's final state).
        timed_out: the launcher stopped the run after config.timeout_s.
        launcher_log: torchrun's own output (its error summary, warnings); for a cluster's job, its output file.
        job_state, job_id: for a cluster's job, its final state as the scheduler says it (COMPLETED, FAILED,
            CANCELLED, ...) and its id; "" otherwise.
        where: where the run ran, as the summary says it ("on 2 agents"; "" for one agent on this machine).
        never_started: if the run was stopped before any rank started, what it waited for (a sentence's
            subject, from the engine); "" otherwise.
        hang: for a timed-out run, what each rank was waiting in and the cause where it can be seen
            (`hang.ranks`, `hang.cause`, `hang.text()`); None otherwise.
    """

    config: LaunchConfig
    ranks: tuple[RankResult, ...]
    wall_time_s: float
    backend: str
    devices: tuple[str, ...]
    job_succeeded: bool
    timed_out: bool = False
    launcher_log: str = ""
    run_id: str = ""
    job_state: str = ""
    job_id: str = ""
    hang: HangReport | None = None
    where: str = ""
    never_started: str = ""

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def ok(self) -> bool:
        return self.job_succeeded and not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def restarts(self) -> int:
        """How many times torchrun restarted the ranks (0: never)."""
        return max((r.restart for r in self.ranks), default=0)

    @property
    def first_failure(self) -> RankResult | None:
        """The rank that failed first: the root cause when one failure set off others."""
        return find_root_cause(self.ranks)

    def facts(self, name: str) -> list:
        """One recorded value from every rank, in rank order: `run.facts("indices")[1]`.
        Raises KeyError naming the ranks that did not record it."""
        unreadable = {r.rank: r.unreadable_facts[name] for r in self.ranks if name in r.unreadable_facts}
        if unreadable:
            raise KeyError(f"{name!r} could not be read back on rank(s) {sorted(unreadable)}: {unreadable}")
        missing = [r.rank for r in self.ranks if name not in r.facts]
        if missing:
            raise KeyError(f"{name!r} was not recorded by rank(s) {missing}; check the record({name!r}, ...) call")
        return [r.facts[name] for r in self.ranks]

    def summary(self) -> str:
        agents = f" {self.where}" if self.where else ""
        restarted = f", restarted {self.restarts} time(s)" if self.restarts else ""
        lines = [
            f"{len(self.ranks)} rank(s){agents}, backend {self.backend}, {self.wall_time_s:.1f} s{restarted}: "
            + ("all ranks finished" if self.ok else "FAILED")
        ]
        queued = bool(self.never_started)
        if self.timed_out and queued:
            lines.append(
                f"Timed out after {self.config.timeout_s:.0f} s while {self.never_started}: it never started, no "
                "rank ran, and it was cancelled. Raise --timeout to wait longer, or ask for fewer nodes, GPUs or "
                "less time."
            )
        elif self.timed_out:
            stacks = any(STACK_HEADING.format(rank=r.rank) in r.stderr for r in self.ranks)
            if self.hang and stacks:
                where = ("The hang report above says what each rank was waiting in, and the cause where the ranks "
                         "show it (run.hang); their stacks follow it ('where rank N was'). ")
            elif self.hang:
                where = "The hang report above says what each rank was waiting in (run.hang); no rank's stack was taken. "
            elif stacks:
                where = ("Where each rank still running was is shown above ('where rank N was'): a rank waiting in a "
                         "collective that another rank never called is the usual cause. ")
            elif not any(r.agent is not None for r in self.ranks):
                where = ("No rank had started its script yet, so there is nothing to show of where it was: starting "
                         "torch and the ranks takes a few seconds. ")
            else:
                where = "No rank's stack could be taken. "
            lines.append(f"Timed out after {self.config.timeout_s:.3g} s: the ranks were stopped. {where}"
                         "Raise --timeout if the work is just slow.")
        root = self.first_failure
        if root is not None:
            # Streamed, its whole message is in the traceback just above: a shorter line here.
            limit = 160 if root.error and self.config.stream else 300
            lines.append(f"Rank {root.rank} failed first, the root cause: {_failure_reason(root, limit)}")
            left = [r.rank for r in self.ranks if r.exit_code == 0]
            if left and root.error and _PEER_CLOSED.search(root.error.message):
                lines.append(f"Its peer went away: rank(s) {left} had finished their script normally (exit code 0) "
                             "while it still waited in a collective. Every rank must make the same collectives "
                             "(the same number of backward() calls under DDP).")
            if root.error and self.config.stream:
                lines.append(f"(its traceback is above, under [rank {root.rank}])")
            elif root.error:
                lines.append(root.error.traceback.rstrip())
        for r in self.ranks:
            consequence = ""
            if root is not None and r is not root and r.error is not None:
                # Streamed, the rank's error was shown as a line of its own above: only how it relates here.
                said = "" if self.config.stream else f": {error_line(r)}"
                consequence = f"{said}, {relation_to_root_cause(r, root)}"
            lines.append(f"  rank {r.rank}: {'never started' if queued else r.status}{consequence}")
            for name, why in r.unreadable_facts.items():
                lines.append(f"    recorded {name!r} could not be read back: {why}")
        if not self.ok and root is None and not self.timed_out and self.launcher_log:
            lines.append("torchrun said:\n" + "\n".join(self.launcher_log.strip().splitlines()[-15:]))
        return "\n".join(lines)

    def raise_for_failure(self) -> "RunResult":
        if not self.ok:
            raise RunFailed(self)
        return self


def error_line(rank: RankResult, limit: int = 200) -> str:
    """A rank's exception as one line of at most `limit` characters."""
    message = (rank.error.message.strip().splitlines() or [""])[0]
    line = f"{rank.error.type}: {message}" if message else rank.error.type
    return line if len(line) <= limit else line[:limit - 3] + "..."


# How gloo and nccl say that the other end of a collective's connection went away.
_PEER_CLOSED = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited",
                          re.IGNORECASE)


def relation_to_root_cause(rank: RankResult, root: RankResult) -> str:
    """How another rank's failure relates to the first: the same exception from the same line of the script
    (every rank ran into it on its own), or a consequence (e.g. a collective whose peer had died)."""
    if root.error is not None and (rank.error.type, rank.error.message, _raised_at(rank)) == (
            root.error.type, root.error.message, _raised_at(root)):
        return f"the same error as rank {root.rank}'s, raised on this rank too"
    return f"a consequence of rank {root.rank}'s failure"


def _raised_at(rank: RankResult) -> str | None:
    """The innermost 'File "...", line N' of a rank's traceback."""
    frames = re.findall(r'^\s*File "[^"]*", line \d+', rank.error.traceback, flags=re.M) if rank.error else []
    return frames[-1].strip() if frames else None


def _failure_reason(rank: RankResult, limit: int = 300) -> str:
    """The root cause in one line (its whole message is in its traceback, shown with the summary)."""
    return error_line(rank, limit=limit) if rank.error is not None else rank.status


class RunFailed(RuntimeError):
    """A launch in which a rank failed or that timed out. `.run` holds the RunResult."""

    def __init__(self, run: RunResult):
        self.run = run
        root = run.first_failure
        if run.timed_out:
            reason = f"timed out after {run.config.timeout_s:.0f} s"
        elif root is not None:
            reason = f"rank {root.rank} failed first ({_failure_reason(root)})"
        else:
            reason = "failed (see the launcher's log: run.launcher_log)"
        super().__init__(f"The run of {run.config.script.name} on {len(run.ranks)} rank(s) {reason}. Details above.")
