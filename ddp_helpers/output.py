"""Per-rank output: one colour per rank (shared with the plots), and the live streaming of each rank's
output files into the notebook, line by line, each line prefixed by its rank."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from .result import RunResult, error_line, relation_to_root_cause
from .run_folder import ATTEMPT_MARK, RunFolder
from .stacks import fold_stack

# matplotlib's tab10 colours, in order: rank r is drawn in RANK_COLORS[r % 10] in every plot.
RANK_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
_RESET = "\x1b[0m"
# A failing rank's traceback is held back until the run ends and its root cause is known; a run that goes on
# longer than this after it (a hang, a rank that handled the error) shows it as it is.
HOLD_TRACEBACK_S = 3.0


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _ansi(hex_color: str) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"\x1b[1;38;2;{r};{g};{b}m"


def rank_prefix(rank: int, color: bool = True) -> str:
    label = f"[rank {rank}]"
    return f"{_ansi(rank_color(rank))}{label}{_RESET}" if color else label


def _redraws(line: bytes) -> list[bytes]:
    """A progress bar (tqdm) redraws its line with "\r": show each non-empty redraw as a line of its own."""
    if b"\r" not in line:
        return [line]
    return [part for part in line.split(b"\r") if part.strip()]


class RankOutputStreamer:
    """Follows every rank's stdout/stderr file and prints complete new lines with a rank prefix.

    Call `poll()` repeatedly while the run is going, `finish()` once at the end (it prints any last line
    that has no newline), then `show_stacks()` (the folded stack dumps of a timed-out run) and
    `show_failures()` with the run's root cause: a rank's traceback is held back until then, so that it
    shows once. `show_failures_once` does the last two."""

    def __init__(self, folder: RunFolder, world_size: int, enabled: bool = True, color: bool = True):
        self._sources = [
            (rank, kind, folder.output(rank, kind)) for rank in range(world_size) for kind in ("stdout", "stderr")
        ]
        # The stack dump a rank writes when a timed-out run asks for it: shown folded, once, at the end.
        self._stacks = {rank: folder.stack_file(rank) for rank in range(world_size)}
        self._offsets = {key[:2]: 0 for key in self._sources}
        self._partial = {key[:2]: b"" for key in self._sources}
        self.enabled = enabled
        self._color = color
        # A rank's traceback, from its "Traceback" line on, is held back until the run's root cause is known
        # (`show_failures`): shown whole for the rank that failed first, as one line for the others.
        self._held: dict[int, _Held] = {}
        self.last_output_at = time.monotonic()  # when a rank last wrote anything (read by the waiting line)

    def poll(self) -> None:
        for rank, kind, path in self._sources:
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[rank, kind])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self.last_output_at = time.monotonic()
            self._offsets[rank, kind] += len(chunk)
            *lines, rest = (self._partial[rank, kind] + chunk).split(b"\n")
            self._partial[rank, kind] = rest
            self._emit(rank, kind, [redraw for line in lines for redraw in _redraws(line)])
        now = time.monotonic()
        for rank in [r for r, held in self._held.items() if now - held.since > HOLD_TRACEBACK_S]:
            self._write(rank, "stderr", self._held.pop(rank).lines)  # the run goes on: show it as it is

    def finish(self) -> None:
        self.poll()
        for (rank, kind), rest in self._partial.items():
            if rest:
                self._emit(rank, kind, [rest])
                self._partial[rank, kind] = b""

    def show_stacks(self) -> None:
        """The stack dumps of a timed-out run, folded to the learner's code, once."""
        stacks, self._stacks = self._stacks, {}
        for rank, path in stacks.items():
            try:
                dump = path.read_text(errors="replace")
            except OSError:
                continue
            if dump.strip():
                self._write(rank, "stderr", [line.encode() for line in _folded(rank, dump)])

    def show_failures(self, root: int | None, one_line: dict[int, str]) -> None:
        """Print the held tracebacks: `root`'s whole (every one whole when no rank is the root cause), each
        other rank's as its `one_line[rank]` (its error and how it relates to the root's)."""
        held, self._held = self._held, {}
        for rank, traceback in sorted(held.items(), key=lambda item: item[0] != root):  # the root cause first
            if root is None or rank == root:
                self._write(rank, "stderr", traceback.lines)
            elif rank in one_line:
                self._write(rank, "stderr", [one_line[rank].encode()])
            else:  # it printed a traceback but was stopped before its error was recorded
                self._write(rank, "stderr", [_last_error_line(traceback.lines) + (
                    f"  (after rank {root}'s failure; its traceback is in run.ranks[{rank}].stderr)").encode()])

    def _emit(self, rank: int, kind: str, lines: list[bytes]) -> None:
        if kind == "stdout" and lines and rank in self._held:
            held = self._held.pop(rank).lines
            # A restart: the held traceback is how the attempt ended.
            if any(line.startswith(ATTEMPT_MARK.encode()) for line in lines):
                self._write(rank, "stderr", [_last_error_line(held) + b"  (how this attempt ended; the traceback "
                                             b"is in run.ranks[%d].stderr)" % rank])
            else:  # the rank went on: a traceback it printed and handled (traceback.print_exc()), shown as it was
                self._write(rank, "stderr", held)
        if kind == "stderr":
            for index, line in enumerate(lines):
                if rank in self._held or line.startswith(b"Traceback (most recent call last):"):
                    self._held.setdefault(rank, _Held(time.monotonic())).lines.extend(lines[index:])
                    lines = lines[:index]
                    break
        self._write(rank, kind, lines)

    def _write(self, rank: int, kind: str, lines: list[bytes]) -> None:
        if not self.enabled or not lines:
            return
        stream = sys.stdout if kind == "stdout" else sys.stderr
        prefix = rank_prefix(rank, self._color)
        stream.write("".join(f"{prefix} {line.decode(errors='replace')}\n" for line in lines))
        stream.flush()


@dataclass
class _Held:
    """A rank's traceback held back from the stream: since when, and its lines."""

    since: float
    lines: list[bytes] = field(default_factory=list)


def _last_error_line(lines: list[bytes]) -> bytes:
    """The exception line of a held traceback: its last line that is not indented (nor ours)."""
    for line in reversed(lines):
        if line.strip() and not line[:1].isspace() and not line.startswith((b"[ddp_helpers]", b"Traceback")):
            return line if len(line) <= 300 else line[:297] + b"..."
    return b"the attempt failed"


def _folded(rank: int, dump: str) -> list[str]:
    shown, folded = fold_stack(dump)
    if not shown:  # no frame of the learner's code at all (the script had not started): show it whole
        return [f"where rank {rank} was when the run timed out (not yet in your script):", *dump.splitlines()]
    return [f"where rank {rank} was when the run timed out (your code, innermost call first; {folded} frames of "
            f"torch, Python and ddp_helpers folded, all kept in run.ranks[{rank}].stderr):", *shown]


def show_failures_once(streamer: RankOutputStreamer, run: RunResult) -> None:
    """A timed-out run's hang report and stacks; then the run's tracebacks, once: the root cause's whole,
    the others' as a line each."""
    if run.hang is not None and streamer.enabled:
        print(run.hang.text(), file=sys.stderr, flush=True)
    streamer.show_stacks()
    root = run.first_failure
    one_line = {r.rank: f"{error_line(r)}  ({relation_to_root_cause(r, root)}; its traceback is in "
                        f"run.ranks[{r.rank}].stderr)" for r in run.ranks if r.error and root}
    streamer.show_failures(root.rank if root else None, one_line)
