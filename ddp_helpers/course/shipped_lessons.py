"""A lesson as shipped, and the learner's own copy of it.

A learner edits a lesson's notebook (an exercise attempt, a cell changed to try something) and JupyterLab saves
it in place. `scripts/launch_lesson.sh N` should still run the lesson as the course ships it, unless asked for the
learner's copy, and one command should bring the shipped lesson back without losing the learner's work.

"As shipped" is the notebook as git's last commit holds it (`git show HEAD:<path>`) in the learner's clone. Two
copies are the same lesson when their cells' sources are (outputs, execution counts and metadata that JupyterLab
saves do not change what runs). Outside a git checkout (a course copied without git, an instructor's own
folder) the file on disk is the lesson.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

#: where `restore` keeps the learner's copy, beside the notebooks (git ignores it)
COPIES_FOLDER = "my_copies"


def shipped_text(notebook: Path) -> str | None:
    """The notebook as the last commit of its git checkout holds it; None outside git or when git does not track
    it (an instructor's own lesson)."""
    folder = notebook.resolve().parent
    try:
        top = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=30)
        if top.returncode != 0:
            return None
        relative = notebook.resolve().relative_to(Path(top.stdout.strip()).resolve()).as_posix()
        shown = subprocess.run(["git", "-C", str(folder), "show", f"HEAD:{relative}"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return shown.stdout if shown.returncode == 0 else None


def _sources(text: str) -> list[tuple[str, str]]:
    import nbformat

    return [(cell.cell_type, cell.source) for cell in nbformat.reads(text, as_version=4).cells]


def edited(notebook: Path) -> str | None:
    """The shipped notebook's text if the learner's copy runs different cells; else None (the same lesson, or
    nothing to compare with)."""
    shipped = shipped_text(notebook)
    if shipped is None:
        return None
    try:
        return shipped if _sources(notebook.read_text()) != _sources(shipped) else None
    except Exception:  # noqa: BLE001 - a copy nbformat cannot read is not the shipped lesson either
        return shipped


def restore(notebook: Path) -> Path | None:
    """Put the shipped lesson back in place of the learner's copy, which is kept in `my_copies/` beside the
    notebooks with the time in its name. Returns where the copy went; None when there was nothing to restore
    (the copy runs the shipped cells already). SystemExit when no shipped version can be found."""
    shipped = shipped_text(notebook)
    if shipped is None:
        raise SystemExit(f"{notebook} is not in a git checkout of the course (or git does not track it): there is no "
                         "shipped version to restore here. Download the course again to get it.")
    if edited(notebook) is None:
        notebook.write_text(shipped)  # outputs of an earlier run dropped too: the lesson exactly as shipped
        return None
    copies = notebook.parent / COPIES_FOLDER
    copies.mkdir(mode=0o700, exist_ok=True)
    kept = copies / f"{notebook.stem}.{time.strftime('%Y%m%d-%H%M%S')}{notebook.suffix}"
    shutil.copy2(notebook, kept)
    notebook.write_text(shipped)
    return kept
