"""Run a lesson's notebook outside Jupyter: `python -m ddp_helpers.course.lesson_runner N` (what
`scripts/launch_lesson.sh N` calls).

The notebook stays the single source: its code cells run in order in a plain IPython shell, so
`%%torchrun` cells launch under torchrun exactly as in JupyterLab (one rank per GPU with nccl, or
CPU ranks with gloo). Each section's heading is printed before its cells' output, each rank's output
with its rank prefix, and what a cell displays as Markdown (a table) as its text; a failure the lesson runs on
purpose (`--may-fail`, or a cell tagged `raises-exception`) is shown whole, as JupyterLab shows it (a hang report,
a traceback: often the lesson's subject), then marked with its own sign, EXPECTED (never ✗, a real failure's). Every matplotlib figure a cell draws is saved as PNG under
`runs/<notebook>/plots/`, and the first failing cell (a failed check, a failed run) ends the program
with exit code 1. It closes with a summary: the checks that held, the failures meant, the exercise
as given (judged wrong, as expected) and where the plots are. Cells tagged `skip-execution` are skipped.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from IPython.core.displaypub import DisplayPublisher

from . import manifest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# An instructor's own copy of the course (or a test's notebooks) in place of notebooks/.
NOTEBOOKS_ENV = "DDP_LESSONS_NOTEBOOKS"


def available_lessons(folder: Path | None = None) -> dict[str, Path]:
    """{key: notebook} of the lessons whose notebooks `folder` holds ("2", and "2b" for a deep dive): the course's,
    by their manifests (`manifest.lessons`), and an instructor's own `NN_name.ipynb` or `NNx_name.ipynb` there that
    no manifest names."""
    folder = folder or Path(os.environ.get(NOTEBOOKS_ENV) or NOTEBOOKS)
    found = {key: folder / lesson.notebook for key, lesson in manifest.lessons().items()
             if (folder / lesson.notebook).is_file()}
    for path in sorted(folder.glob("[0-9][0-9]*_*.ipynb")):
        own = OWN_NOTEBOOK.fullmatch(path.name)
        if own and path not in found.values():
            found.setdefault(f"{int(own.group(1))}{own.group(2)}", path)
    return dict(sorted(found.items(), key=lambda item: _order(item[0])))


#: an instructor's own lesson: `07_name.ipynb`, or a deep dive `07b_name.ipynb`
OWN_NOTEBOOK = re.compile(r"(\d\d)([a-z]?)_.+\.ipynb")
#: a lesson's key as typed: "2", "02", a deep dive "2b" or "02b"
KEY = re.compile(r"(\d{1,2})([a-z]?)")


def _order(key: str) -> tuple[int, str]:
    number, part = KEY.fullmatch(key).groups()
    return int(number), part


def find_lesson(argument: str, folder: Path | None = None) -> Path:
    """The notebook of lesson `argument` ("2" or "02", a deep dive "2b" or "02b"), or SystemExit listing the lessons
    there are."""
    lessons = available_lessons(folder)
    match = KEY.fullmatch(argument.strip().lower())
    key = match and f"{int(match.group(1))}{match.group(2)}"
    if key in lessons:
        return lessons[key]
    listing = "\n".join(f"  {key:<3} {path.stem.split('_', 1)[-1].replace('_', ' ')}" for key, path in lessons.items())
    raise SystemExit(f"No lesson {argument!r}. Lessons available:\n{listing}\nUsage: scripts/launch_lesson.sh N "
                     "(a deep dive: 2b)")


class PngSavingPublisher(DisplayPublisher):
    """Prints what cells display, as a terminal shell does, and also saves each displayed PNG image
    (the static fallback of a widget, for example) to the plots folder."""

    def __init__(self, folder: Path, **kwargs):
        super().__init__(**kwargs)
        self.folder = folder
        self.saved: list[Path] = []

    def publish(self, data, *args, **kwargs):
        if "text/markdown" in data and "image/png" not in data:  # a table: its text, not the object's repr
            print(data["text/markdown"].rstrip("\n"), flush=True)
            return
        if "image/png" in data:
            path = self.folder / f"displayed{len(self.saved) + 1:02d}.png"
            path.write_bytes(base64.b64decode(data["image/png"]))
            self.saved.append(path)
        super().publish(data, *args, **kwargs)


class CellOutput:
    """What a cell prints, shown at once and kept for the closing summary (its ✓ lines)."""

    def __init__(self, shown):
        self.shown, self.text = shown, []

    def write(self, data: str) -> int:
        self.text.append(data)
        self.shown.write(data)
        return len(data)

    def flush(self) -> None:
        self.shown.flush()

    def __getattr__(self, name):  # isatty, encoding, fileno: the terminal's
        return getattr(self.shown, name)


def headings(markdown: str) -> list[str]:
    """A markdown cell's section headings (# to ###), as the terminal shows them; a `#` comment inside a fenced
    code block is code, not a heading."""
    found, in_code = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,3} \S", line):
            found.append(line.strip())
    return found


#: the sign of a failure the lesson runs on purpose (✗ is a real failure's)
EXPECTED = "\u2298"


def expected_failure(source: str, tags: set[str]) -> bool:
    """A cell the lesson expects to fail: tagged raises-exception, or a %%torchrun cell with --may-fail."""
    first = source.split("\n", 1)[0]
    return "raises-exception" in tags or (first.startswith("%%torchrun") and "--may-fail" in first.split())


def expected_line(source: str, shell) -> str | None:
    """One line after an expected failure's output: what failed, as the run says it; None when it did not fail."""
    match = re.search(r"--out[ =](\S+)", source.split("\n", 1)[0])
    run = shell.user_ns.get(match.group(1)) if match else None
    if run is None or getattr(run, "ok", True):
        return None
    said = run.summary().splitlines()
    reason = said[1] if len(said) > 1 else said[0]
    if run.hang is not None:
        reason = run.hang.cause.split(". ")[0]
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    return (f"{EXPECTED} expected: `{match.group(1)}` {'timed out' if run.timed_out else 'failed'}, as the lesson means "
            f"it to: {reason}")


@dataclass
class LessonTally:
    """What the cells run so far showed, for the closing summary."""

    held: int = 0  # ✓ lines printed
    seen: int = 0  # • lines printed: what torch itself did
    expected: list = field(default_factory=list)  # one line per failure the lesson runs on purpose
    exercises: list = field(default_factory=list)  # (code cell number, ExerciseReport)
    images: list = field(default_factory=list)  # PNG files saved


def run_notebook(notebook: Path, text: str | None = None) -> int:
    """Run every code cell of `notebook` (or of `text`, another version of it: the lesson as shipped, run in the
    notebook's place); return 0 if all behaved, 1 otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import nbformat
    from IPython.core.interactiveshell import InteractiveShell

    from ..cells import notebook_key
    from ..run_folder import runs_root
    from ..private_folders import private_folder

    plots = private_folder(runs_root() / notebook_key(notebook.resolve()) / "plots")
    for old in plots.glob("*.png"):
        old.unlink()
    shell = InteractiveShell.instance()
    shell.display_pub = PngSavingPublisher(shell=shell, folder=plots)
    shell.user_ns["__session__"] = str(notebook)
    os.chdir(notebook.parent)
    all_cells = (nbformat.reads(text, as_version=4) if text is not None else nbformat.read(notebook, as_version=4)).cells
    code_count = sum(c.cell_type == "code" for c in all_cells)
    tally, pending, index = LessonTally(), [], 0
    for cell in all_cells:
        if cell.cell_type == "markdown":
            pending += headings(cell.source)
            continue
        if cell.cell_type != "code":
            continue
        index += 1
        if "skip-execution" in cell.metadata.get("tags", []):
            continue
        for heading in pending:
            print(f"\n{heading}", flush=True)
        pending = []
        print(f"\n=== {notebook.name}, code cell {index} of {code_count} ===", flush=True)
        if not run_code_cell(shell, cell, index, notebook.name, plots, tally):
            return 1
    tally.images += shell.display_pub.saved
    print(closing_summary(notebook, code_count, tally, plots))
    return 0


def run_code_cell(shell, cell, index: int, notebook_name: str, plots: Path, tally: LessonTally) -> bool:
    """Run one code cell, marking a failure the lesson means (EXPECTED), saving its figures; False when the
    lesson must stop (a cell failed that should not have, or one tagged raises-exception did not)."""
    import matplotlib.pyplot as plt

    from .exercises import ExerciseReport

    tags = set(cell.metadata.get("tags", []))
    expected = expected_failure(cell.source, tags)
    output, errors = CellOutput(sys.stdout), CellOutput(sys.stderr)
    sys.stdout, sys.stderr = output, errors
    try:
        result = shell.run_cell(cell.source, store_history=True)
    finally:
        sys.stdout, sys.stderr = output.shown, errors.shown
    printed = "".join(output.text).splitlines()
    tally.held += sum(line.startswith("\u2713 ") for line in printed)
    tally.seen += sum(line.startswith("\u2022 ") for line in printed)
    if expected:
        line = expected_line(cell.source, shell)
        if line is None and "raises-exception" in tags and not result.success:
            line = f"{EXPECTED} expected: the cell raised, as the lesson means it to: {result.error_in_exec!r}"[:200]
        if line is not None:  # shown whole above, as in JupyterLab; marked as meant
            tally.expected.append(line)
            sys.stderr.flush()
            print(line, flush=True)
    if isinstance(result.result, ExerciseReport):
        tally.exercises.append((index, result.result))
    for number in plt.get_fignums():
        path = plots / f"cell{index:02d}_figure{number}.png"
        plt.figure(number).savefig(path, dpi=100, bbox_inches="tight")
        tally.images.append(path)
    plt.close("all")
    if "raises-exception" in tags and result.success:
        print(f"Cell {index} should have failed (tagged raises-exception) but did not.", file=sys.stderr)
        return False
    if "raises-exception" not in tags and not result.success:
        print(f"\nStopped: code cell {index} of {notebook_name} failed (see above).", file=sys.stderr)
        return False
    return True


def closing_summary(notebook: Path, cells: int, tally: LessonTally, plots: Path) -> str:
    """What the lesson's run showed, for the end of the terminal's output."""
    held, expected, exercises, images = tally.held, tally.expected, tally.exercises, tally.images
    lines = [f"\n=== Summary of {notebook.name} ===", f"All {cells} code cells of {notebook.name} ran."]
    if held:
        lines.append(f"\u2713 {held} check{'s' if held != 1 else ''} held on your run.")
    if tally.seen:
        lines.append(f"\u2022 {tally.seen} thing{'s' if tally.seen != 1 else ''} torch itself did, shown by your run.")
    if expected:
        lines.append(f"{EXPECTED} {len(expected)} failure{'s' if len(expected) != 1 else ''} the lesson runs on purpose, "
                     f"shown above in full and marked {EXPECTED}.")
    for index, report in exercises:
        if report.passed:
            lines.append(f"The exercise (code cell {index}): all checks pass.")
        else:
            count = len(report.mistakes)
            lines.append(f"The exercise (code cell {index}) as given: judged wrong, as expected ({count} mistake"
                         f"{'s' if count != 1 else ''} to find). Now solve it in JupyterLab: "
                         f"`.venv/bin/jupyter lab notebooks/`, then {notebook.name}.")
    if images:
        lines.append(f"Plots: {len(images)} PNG file{'s' if len(images) != 1 else ''} in {plots}")
    else:
        lines.append("Plots: none in this lesson.")
    return "\n".join(lines)


USAGE = ("Usage: scripts/launch_lesson.sh N [--mine]   (N: the lesson number, e.g. 2; --mine: your edited copy "
         "instead of the lesson as shipped)\n       scripts/launch_lesson.sh N --restore   (the shipped lesson back "
         "in place of yours, which is kept in notebooks/my_copies/)")


def main(argv: list[str] | None = None) -> int:
    from .shipped_lessons import edited, restore

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] not in ("--mine", "--restore")):
        raise SystemExit(USAGE)
    notebook = find_lesson(argv[0])
    if argv[1:] == ["--restore"]:
        kept = restore(notebook)
        print(f"{notebook.name} is the lesson as shipped again; "
              + (f"your copy is kept as {kept}." if kept else "your copy ran the same cells (only outputs differed)."))
        return 0
    shipped = None if argv[1:] == ["--mine"] else edited(notebook)
    if shipped is not None:
        print(f"[ddp_helpers] notebooks/{notebook.name} has your edits: running the lesson as shipped. "
              f"`scripts/launch_lesson.sh {argv[0]} --mine` runs yours; `scripts/launch_lesson.sh {argv[0]} --restore` "
              "puts the shipped one back in JupyterLab too, keeping yours in notebooks/my_copies/.", flush=True)
    return run_notebook(notebook, shipped)


if __name__ == "__main__":
    sys.exit(main())
