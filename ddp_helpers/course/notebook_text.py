"""Text for the notebook's outputs: JupyterLab breaks a long output line wherever the panel ends, in
the middle of a word, so the lines the course prints are wrapped at word boundaries first."""

from __future__ import annotations

import textwrap

# Most notebook panels show this many characters of an output line whole.
LINE_WIDTH = 100


def wrapped(text: str, first_line_taken: int = 0) -> str:
    """`text` wrapped at word boundaries to LINE_WIDTH, each of its own lines apart, continuation lines
    indented by two; the first line starts `first_line_taken` characters in."""
    lines = []
    for line in text.splitlines() or [""]:
        filled = textwrap.wrap(" " * first_line_taken + line, width=LINE_WIDTH, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False, drop_whitespace=True) or [""]
        filled[0] = filled[0][first_line_taken:] if filled[0].startswith(" " * first_line_taken) else filled[0].lstrip()
        lines += filled
        first_line_taken = 0
    return "\n".join(lines)
