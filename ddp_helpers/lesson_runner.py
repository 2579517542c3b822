"""Run a lesson's notebook outside Jupyter: `python -m ddp_helpers.lesson_runner N` (what
`scripts/launch_lesson.sh N` calls).

The notebook stays the single source: its code cells run in order in a plain IPython shell, so
`%%torchrun` cells launch under torchrun exactly as in JupyterLab (one rank per GPU with nccl, or
CPU ranks with gloo). Each rank's output is printed with its rank prefix, every matplotlib figure a
cell draws is saved as PNG under `runs/<notebook>/plots/`, and the first failing cell (a failed
check, a failed run) ends the program with exit code 1. Cells tagged `skip-execution` are skipped;
cells tagged `raises-exception` must fail.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from pathlib import Path

from IPython.core.displaypub import DisplayPublisher

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
# An instructor's own copy of the course (or a test's notebooks) in place of notebooks/.
NOTEBOOKS_ENV = "DDP_LESSONS_NOTEBOOKS"


def available_lessons(folder: Path | None = None) -> dict[int, Path]:
    folder = folder or Path(os.environ.get(NOTEBOOKS_ENV) or NOTEBOOKS)
    lessons = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        lessons[int(path.name[:2])] = path
    return lessons


def find_lesson(argument: str, folder: Path | None = None) -> Path:
    """The notebook of lesson `argument` ("2" or "02"), or SystemExit listing the lessons there are."""
    lessons = available_lessons(folder)
    if re.fullmatch(r"\d{1,2}", argument.strip()) and int(argument) in lessons:
        return lessons[int(argument)]
    listing = "\n".join(f"  {n}  {path.stem[3:].replace('_', ' ')}" for n, path in lessons.items())
    raise SystemExit(f"No lesson {argument!r}. Lessons available:\n{listing}\nUsage: scripts/launch_lesson.sh N")


class PngSavingPublisher(DisplayPublisher):
    """Prints what cells display, as a terminal shell does, and also saves each displayed PNG image
    (the static fallback of a widget, for example) to the plots folder."""

    def __init__(self, folder: Path, **kwargs):
        super().__init__(**kwargs)
        self.folder = folder
        self.saved: list[Path] = []

    def publish(self, data, *args, **kwargs):
        if "image/png" in data:
            path = self.folder / f"displayed{len(self.saved) + 1:02d}.png"
            path.write_bytes(base64.b64decode(data["image/png"]))
            self.saved.append(path)
        super().publish(data, *args, **kwargs)


def run_notebook(notebook: Path) -> int:
    """Run every code cell of `notebook`; return 0 if all behaved, 1 otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import nbformat
    from IPython.core.interactiveshell import InteractiveShell

    from .cells import notebook_key
    from .config import runs_root
    from .private_folders import private_folder

    plots = private_folder(runs_root() / notebook_key(notebook.resolve()) / "plots")
    for old in plots.glob("*.png"):
        old.unlink()
    shell = InteractiveShell.instance()
    shell.display_pub = PngSavingPublisher(shell=shell, folder=plots)
    shell.user_ns["__session__"] = str(notebook)
    os.chdir(notebook.parent)
    cells = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
    saved = []
    for index, cell in enumerate(cells, start=1):
        tags = set(cell.metadata.get("tags", []))
        if "skip-execution" in tags:
            continue
        print(f"\n=== {notebook.name}, code cell {index} of {len(cells)} ===", flush=True)
        result = shell.run_cell(cell.source, store_history=True)
        for number in plt.get_fignums():
            path = plots / f"cell{index:02d}_figure{number}.png"
            plt.figure(number).savefig(path, dpi=100, bbox_inches="tight")
            saved.append(path)
        plt.close("all")
        if "raises-exception" in tags:
            if result.success:
                print(f"Cell {index} should have failed (tagged raises-exception) but did not.", file=sys.stderr)
                return 1
        elif not result.success:
            print(f"\nStopped: code cell {index} of {notebook.name} failed (see above).", file=sys.stderr)
            return 1
    print(f"\nAll {len(cells)} code cells of {notebook.name} ran; plots saved:")
    for path in [*saved, *shell.display_pub.saved]:
        print(f"  {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("Usage: scripts/launch_lesson.sh N   (N: the lesson number, e.g. 2)")
    return run_notebook(find_lesson(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
