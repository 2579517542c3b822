"""What a launch hands back: `RunResult`, with one `RankResult` per rank, and `RunFailed`."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from .config import LaunchConfig


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


@dataclass(frozen=True)
class RankResult:
    """One rank's part of a run.

    Attributes:
        rank: the global rank.
        exit_code: the code the rank's script ended with; for a rank stopped from outside (by torchrun
            after another rank failed) minus the signal number, as torchrun reports it; None when
            unknown (the launcher's timeout or interrupt stopped the run).
        stdout, stderr: everything the rank printed, not interleaved with other ranks.
        facts: the values it recorded with `ddp_helpers.record`, by name.
        error: the exception that ended it, if any.
    """

    rank: int
    exit_code: int | None
    stdout: str
    stderr: str
    facts: dict = field(default_factory=dict)
    error: RankError | None = None

    @property
    def status(self) -> str:
        if self.exit_code == 0:
            return "ok"
        if self.exit_code is None:
            return "stopped"
        if self.exit_code < 0:
            return f"stopped ({_signal_name(-self.exit_code)})"
        return f"failed (exit code {self.exit_code})"


@dataclass(frozen=True)
class RunResult:
    """A finished launch.

    Attributes:
        config: the LaunchConfig that was run.
        ranks: one RankResult per rank, indexed by rank: `run.ranks[1].facts["indices"]`.
        wall_time_s: seconds from launch to the end of cleanup.
        backend: "gloo" or "nccl".
        devices: the device each rank was given ("cpu" or "cuda:k").
        returncode: torchrun's exit code (None if it had to be killed).
        timed_out: the launcher stopped the run after config.timeout_s.
        launcher_log: torchrun's own output (its error summary, warnings).
    """

    config: LaunchConfig
    ranks: tuple[RankResult, ...]
    wall_time_s: float
    backend: str
    devices: tuple[str, ...]
    returncode: int | None
    timed_out: bool = False
    launcher_log: str = ""

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def first_failure(self) -> RankResult | None:
        """The rank whose exception came first: the root cause when one failure set off others."""
        failed = [r for r in self.ranks if r.error is not None]
        if failed:
            return min(failed, key=lambda r: r.error.time)
        nonzero = [r for r in self.ranks if r.exit_code is not None and r.exit_code > 0]
        return nonzero[0] if nonzero else None

    def facts(self, name: str) -> list:
        """One recorded value from every rank, in rank order: `run.facts("indices")[1]`.
        Raises KeyError naming the ranks that did not record it."""
        missing = [r.rank for r in self.ranks if name not in r.facts]
        if missing:
            raise KeyError(f"{name!r} was not recorded by rank(s) {missing}; check the record({name!r}, ...) call")
        return [r.facts[name] for r in self.ranks]

    def summary(self) -> str:
        lines = [
            f"{len(self.ranks)} rank(s), backend {self.backend}, {self.wall_time_s:.1f} s: "
            + ("all ranks finished" if self.ok else "FAILED")
        ]
        if self.timed_out:
            lines.append(
                f"Timed out after {self.config.timeout_s:.0f} s: the ranks were stopped. Stacks of the ranks still "
                "running are above (look for 'Thread' ... 'most recent call first'): a rank waiting in a collective "
                "that another rank never called is the usual cause. Raise --timeout if the work is just slow."
            )
        root = self.first_failure
        if root is not None:
            lines.append(f"Rank {root.rank} failed first" + (f": {root.error.type}: {root.error.message}" if root.error else f" with exit code {root.exit_code}"))
            if root.error:
                lines.append(root.error.traceback.rstrip())
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.status}")
        if not self.ok and root is None and not self.timed_out and self.launcher_log:
            lines.append("torchrun said:\n" + "\n".join(self.launcher_log.strip().splitlines()[-15:]))
        return "\n".join(lines)

    def raise_for_failure(self) -> "RunResult":
        if not self.ok:
            raise RunFailed(self)
        return self


class RunFailed(RuntimeError):
    """A launch in which a rank failed or that timed out. `.run` holds the RunResult."""

    def __init__(self, run: RunResult):
        self.run = run
        root = run.first_failure
        if run.timed_out:
            reason = f"timed out after {run.config.timeout_s:.0f} s"
        elif root is not None:
            reason = f"rank {root.rank} failed first" + (f" ({root.error.type}: {root.error.message})" if root.error else "")
        else:
            reason = f"torchrun exited with {run.returncode}"
        super().__init__(f"The run of {run.config.script.name} on {len(run.ranks)} rank(s) {reason}. Details above.")
