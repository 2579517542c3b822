"""Widgets the lessons share (ipywidgets), with a static fallback: without a live widget frontend (nbmake,
nbconvert, `launch_lesson.sh`) the display shows a fallback carried in the same output. Each lesson's own
widgets are in `lessons/` (lesson 2's partition explorer: `lessons/lesson2_explorer.py`).
"""

from __future__ import annotations


def display_with_fallback(widget, fallback: dict[str, str]) -> None:
    """Display `widget`; frontends that cannot render widgets show `fallback` (mimetype -> data) instead."""
    from IPython.display import display

    bundle = widget._repr_mimebundle_() or {}
    bundle.update(fallback)
    display(bundle, raw=True)
