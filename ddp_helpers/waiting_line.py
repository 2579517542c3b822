"""The line a launch shows while its ranks are silent: how long no rank has printed, which collective each
rank has not finished (asked of the ranks quietly, `_hang_probe.PEEK`), and what to press to see where each rank
is (the stop button prints the hang report). Updated in place, and taken away as soon as a rank prints again:
one display output in a notebook (never one line per second in the saved file), one line redrawn with a
carriage return in a terminal."""

from __future__ import annotations

import sys
import time
from typing import Callable

from .hang import unfinished_line

#: seconds without a line from any rank before the line shows
SILENT_FOR_S = 10.0
_REDRAW_S = 1.0
#: how often a silent run's ranks are asked what they have not finished
ASK_EVERY_S = 3.0


class WaitingLine:
    """Call `tick(last_output_at)` at each poll of a run; `clear()` once it ends. `ask` asks the ranks what they
    have not finished, `answers` takes the answers that came in ({rank: answer}); without them the line
    says how long the run has been silent only."""

    def __init__(self, timeout_s: float, enabled: bool = True, ask: Callable[[], None] | None = None,
                 answers: Callable[[], dict[int, dict]] | None = None):
        self.timeout_s, self.enabled = timeout_s, enabled
        self._ask, self._answers = ask, answers
        self.started = time.monotonic()
        self._shown_at: float | None = None
        self._asked_at: float | None = None
        self._unfinished: dict[int, dict] = {}  # the latest answer of each rank, while this silence lasts
        self._display = None  # a notebook's display handle, once shown there

    def tick(self, last_output_at: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        silent = now - max(last_output_at, self.started)
        if silent < SILENT_FOR_S:
            self.clear()
            return
        self._ask_the_ranks(now)
        if self._shown_at is None or now - self._shown_at >= _REDRAW_S:
            where = unfinished_line(self._unfinished)
            where = f"{where[0].upper()}{where[1:]}." if where else "Waiting in a collective another rank never calls?"
            self._show(f"[ddp_helpers] no rank has printed for {silent:.0f} s ({now - self.started:.0f} s of the "
                       f"run's {self.timeout_s:g} s timeout). {where} Press stop to see where each rank is.")
            self._shown_at = now

    def _ask_the_ranks(self, now: float) -> None:
        if self._ask is None or self._answers is None:
            return
        try:
            self._unfinished.update(self._answers())
            if self._asked_at is None or now - self._asked_at >= ASK_EVERY_S:
                self._asked_at = now
                self._ask()
        except OSError:  # a rank's pipe or file went away as it ended: the line says less, the run goes on
            pass

    def clear(self) -> None:
        if self._asked_at is not None and self._answers is not None:  # asked during this silence: drop late answers
            try:
                self._answers()
            except OSError:
                pass
        self._unfinished, self._asked_at = {}, None
        if self._shown_at is None:
            return
        self._shown_at = None
        if self._display is not None:
            self._display.update(_Text(""))
        else:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()

    def _show(self, text: str) -> None:
        if "ipykernel" in sys.modules:
            from IPython.display import display

            if self._display is None:
                self._display = display(_Text(text), display_id=True)
            else:
                self._display.update(_Text(text))
            return
        sys.stderr.write("\r\x1b[2K" + text)
        sys.stderr.flush()


class _Text:
    """Plain text for IPython's display, without the quotes a str's repr would add."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text
