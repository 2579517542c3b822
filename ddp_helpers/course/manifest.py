"""The course's lessons, each one folder: `course/lessons/lessonN/` holds the lesson's code (its module, plots, quiz,
checker) and `lesson.toml`, its manifest, which names what the course's tools need to know of it: its notebook in
notebooks/, the README's row, its exercise's checker and quiz, its tests, what the browser test must see, and its
ledger of ✓ checks (`checks.md` beside it). The lesson runner, the browser test, the quick loop's list of slow
tests and the ledger check all read the manifests: adding a lesson is its folder and its notebook.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

LESSONS_FOLDER = Path(__file__).resolve().parent / "lessons"
MANIFEST = "lesson.toml"
LEDGER = "checks.md"


@dataclass(frozen=True)
class BrowserExpectation:
    """What JupyterLab must show after running the whole notebook: a check its run confirms (its text), the hint
    its exercise as given gets from the checker, and how many plots render as images."""

    confirmed: str | None = None
    judged: str | None = None
    plots: int = 0


@dataclass(frozen=True)
class Lesson:
    number: int
    folder: Path
    notebook: str
    summary: str
    time: str
    checker: str
    quiz: str
    tests: tuple[str, ...]
    slow: bool
    browser: BrowserExpectation

    @property
    def package(self) -> str:
        return f"{__package__}.lessons.{self.folder.name}"

    @property
    def ledger(self) -> Path:
        """Its ✓ checks, each with a script it fails for (may not exist: a lesson with no ✓)."""
        return self.folder / LEDGER

    @property
    def readme_row(self) -> str:
        return f"| {self.number} | `{self.notebook}` | {self.summary} | {self.time} |"

    def load_checker(self):
        module, _, function = self.checker.rpartition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}" if module else self.package), function)

    def load_quiz(self) -> list:
        return importlib.import_module(f"{self.package}.{self.quiz}").QUESTIONS


def read_manifest(path: Path) -> Lesson:
    """The lesson whose manifest is `path`; ValueError naming the file and what is wrong with it."""
    try:
        data = tomllib.loads(path.read_text())
        return Lesson(number=int(data["number"]), folder=path.parent, notebook=data["notebook"],
                      summary=data.get("summary", ""), time=data.get("time", ""), checker=data["checker"],
                      quiz=data.get("quiz", "quiz"), tests=tuple(data.get("tests", ())), slow=bool(data.get("slow")),
                      browser=BrowserExpectation(**data.get("browser", {})))
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path}: not a lesson manifest ({type(error).__name__}: {error}); see "
                         f"{LESSONS_FOLDER / 'lesson0' / MANIFEST} for one") from None


def lessons(folder: Path = LESSONS_FOLDER) -> dict[int, Lesson]:
    """Every lesson of the course by number, from its folder's manifest."""
    found = {}
    for path in sorted(folder.glob(f"*/{MANIFEST}")):
        lesson = read_manifest(path)
        if lesson.number in found:
            raise ValueError(f"{path}: lesson {lesson.number} is also {found[lesson.number].folder / MANIFEST}")
        found[lesson.number] = lesson
    return dict(sorted(found.items()))
