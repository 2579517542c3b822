"""Per-rank output: one colour per rank (shared with the plots), and the live streaming of each rank's
output files into the notebook, line by line, each line prefixed by its rank."""

from __future__ import annotations

import sys
from .run_folder import RunFolder

# matplotlib's tab10 colours, in order: rank r is drawn in RANK_COLORS[r % 10] in every plot.
RANK_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
_RESET = "\x1b[0m"


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


class TextInFile:
    """Whether `text` has appeared in a growing file (a rank's output), reading only what was added since
    the last look."""

    def __init__(self, path, text: str):
        self._path, self._text = path, text.encode()
        self._offset, self._tail = 0, b""

    def seen(self) -> bool:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return False
        self._offset += len(chunk)
        window = self._tail + chunk
        if self._text in window:
            return True
        self._tail = window[len(window) - len(self._text) + 1:]  # the text may straddle two reads
        return False


class RankOutputStreamer:
    """Follows every rank's stdout/stderr file and prints complete new lines with a rank prefix.

    Call `poll()` repeatedly while the run is going and `finish()` once at the end (it prints any
    last line that has no newline)."""

    def __init__(self, folder: RunFolder, nproc: int, enabled: bool = True, color: bool = True):
        # "stack": the stack dump a rank writes when a timed-out run asks for it; shown as stderr.
        self._sources = [
            (rank, kind, folder.rank_file(rank, kind)) for rank in range(nproc) for kind in ("stdout", "stderr", "stack")
        ]
        self._offsets = {key[:2]: 0 for key in self._sources}
        self._partial = {key[:2]: b"" for key in self._sources}
        self._enabled = enabled
        self._color = color

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
            self._offsets[rank, kind] += len(chunk)
            *lines, rest = (self._partial[rank, kind] + chunk).split(b"\n")
            self._partial[rank, kind] = rest
            self._emit(rank, kind, [redraw for line in lines for redraw in _redraws(line)])

    def finish(self) -> None:
        self.poll()
        for (rank, kind), rest in self._partial.items():
            if rest:
                self._emit(rank, kind, [rest])
                self._partial[rank, kind] = b""

    def _emit(self, rank: int, kind: str, lines: list[bytes]) -> None:
        if not self._enabled or not lines:
            return
        stream = sys.stdout if kind == "stdout" else sys.stderr
        prefix = rank_prefix(rank, self._color)
        stream.write("".join(f"{prefix} {line.decode(errors='replace')}\n" for line in lines))
        stream.flush()
