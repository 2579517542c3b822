"""The course's lessons, each one folder: `course/lessons/lessonN/` holds the lesson's code (its module, plots, quiz,
checker) and `lesson.toml`, its manifest, which names what the course's tools need to know of it: its notebook in
notebooks/, the README's row, its exercise's checker and quiz, its tests, what the browser test must see, and its
ledger of ✓ checks (`checks.md` beside it). A lesson of the core path has a number (`lesson2/`); a deep dive beside
it has the number and a letter (`lesson2b/`, "2b", its notebook `02b_...ipynb`): read after lesson 2, before 3, by
whoever wants the depth; the core path never needs it. The lesson runner, the browser test, the quick loop's list of slow
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
    part: str  # "" for a lesson of the core path, a letter for a deep dive beside it ("b" in 2b)
    folder: Path
    notebook: str
    summary: str
    time: str
    checker: str | None  # a deep dive may have no exercise
    quiz: str
    tests: tuple[str, ...]
    slow: bool
    browser: BrowserExpectation

    @property
    def key(self) -> str:
        """What a learner types to run it (`scripts/launch_lesson.sh 2b`): "2", or "2b" for a deep dive."""
        return f"{self.number}{self.part}"

    @property
    def deep_dive(self) -> bool:
        return bool(self.part)

    @property
    def package(self) -> str:
        return f"{__package__}.lessons.{self.folder.name}"

    @property
    def ledger(self) -> Path:
        """Its ✓ checks, each with a script it fails for (may not exist: a lesson with no ✓)."""
        return self.folder / LEDGER

    @property
    def readme_row(self) -> str:
        return f"| {self.key} | `{self.notebook}` | {self.summary} | {self.time} |"

    def load_checker(self):
        """The exercise's checker; None for a deep dive without an exercise."""
        if not self.checker:
            return None
        module, _, function = self.checker.rpartition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}" if module else self.package), function)

    def load_quiz(self) -> list:
        return importlib.import_module(f"{self.package}.{self.quiz}").QUESTIONS


def read_manifest(path: Path) -> Lesson:
    """The lesson whose manifest is `path`; ValueError naming the file and what is wrong with it."""
    try:
        data = tomllib.loads(path.read_text())
        part = str(data.get("part", ""))
        if part and not (len(part) == 1 and part.isalpha() and part.islower()):
            raise ValueError(f"part = {part!r}: one lower-case letter, a deep dive's (\"b\" for 2b)")
        notebook = data["notebook"]
        checker = data["checker"] if not part else data.get("checker")  # only a core lesson must have an exercise
        return Lesson(number=int(data["number"]), part=part, folder=path.parent, notebook=notebook,
                      summary=data.get("summary", ""), time=data.get("time", ""), checker=checker,
                      quiz=data.get("quiz", "quiz"), tests=tuple(data.get("tests", ())), slow=bool(data.get("slow")),
                      browser=BrowserExpectation(**data.get("browser", {})))
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path}: not a lesson manifest ({type(error).__name__}: {error}); see "
                         f"{LESSONS_FOLDER / 'lesson0' / MANIFEST} for one") from None


def lessons(folder: Path = LESSONS_FOLDER) -> dict[str, Lesson]:
    """Every lesson of the course by its key ("2", "2b"), in the course's order (each lesson, then its deep dives),
    from its folder's manifest."""
    found = {}
    for path in sorted(folder.glob(f"*/{MANIFEST}")):
        lesson = read_manifest(path)
        if lesson.key in found:
            raise ValueError(f"{path}: lesson {lesson.key} is also {found[lesson.key].folder / MANIFEST}")
        found[lesson.key] = lesson
    return dict(sorted(found.items(), key=lambda item: (item[1].number, item[1].part)))
