"""Watching a growing file (a rank's output) for a line of text: the launcher's --kill-after and the
supervisor's --join-after both wait for one. Stdlib only: the kernel's side and the supervisor's side load it."""

from __future__ import annotations

_LONGEST_LINE = 1 << 20  # a "line" this long without a newline counts as ended


class TextInFile:
    """Whether `text` has appeared in a growing file (a rank's output), reading only what was added since
    the last look. It counts as seen once the line that holds it is complete: an unbuffered print (python -u,
    PYTHONUNBUFFERED) writes the text and its newline separately, and a rank killed between the two would
    leave half a line for its next attempt's output to run into."""

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
        at = window.find(self._text)
        if at < 0:
            self._tail = window[len(window) - len(self._text) + 1:]  # the text may straddle two reads
            return False
        if b"\n" in window[at + len(self._text):] or len(window) - at > _LONGEST_LINE:
            return True
        self._tail = window[at:]  # found, its line not yet ended
        return False
