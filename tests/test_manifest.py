"""A lesson is one folder with its manifest, plus its notebook (issue 51): a throwaway lesson 99 added to a copy of
the project, with no other file edited, is run by the lesson runner, listed by the browser test, and held by the
ledger check; and a manifest that is not one says which file and why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from ddp_helpers.course.lesson_runner import find_lesson
from ddp_helpers.course.manifest import lessons, read_manifest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

MANIFEST = """\
number = 99
notebook = "99_throwaway.ipynb"
summary = "a lesson made by a test"
time = "1 s"
checker = ":check_nothing"
tests = []

[browser]
confirmed = "✓ two and two make four"
plots = 0
"""
CHECK = '- `c0ffee00` "two and two make four" — fails if the cell adds 2 and 3\n'


def project_with_lesson_99(folder: Path, ledger: str) -> Path:
    """A copy of the project's tracked files (a learner's unpacked archive: no git) with lesson 99 added."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, tracked.split("\0")):
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    lesson = folder / "ddp_helpers" / "course" / "lessons" / "lesson99"
    lesson.mkdir()
    (lesson / "lesson.toml").write_text(MANIFEST)
    (lesson / "__init__.py").write_text("def check_nothing(run):\n    return None\n")
    (lesson / "quiz.py").write_text("from ...quiz import Question\n\nQUESTIONS = [Question('2 + 2?', ('4', '5'), 0, 'four', 'add')]\n")
    (lesson / "checks.md").write_text(ledger)
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("from ddp_helpers.course.checks import check\n"
                                     "check(2 + 2 == 4, 'two and two make four', 'arithmetic broke')")
    cell.id = "c0ffee00"
    notebook.cells = [nbformat.v4.new_markdown_cell("# Lesson 99"), cell]
    nbformat.write(notebook, folder / "notebooks" / "99_throwaway.ipynb")
    return folder


def run_in(project: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(project)}  # the copy's package, not the installed one
    for name in ("DDP_LESSONS_COURSE_UNDER_TEST", "DDP_LESSONS_NOTEBOOKS", "PYTEST_XDIST_WORKER"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *command], cwd=project, env=env, capture_output=True, text=True, timeout=240)


def test_a_new_lesson_is_its_folder_and_its_notebook(tmp_path):
    project = project_with_lesson_99(tmp_path / "project", ledger=CHECK)

    ran = run_in(project, "-m", "ddp_helpers.course.lesson_runner", "99")
    assert ran.returncode == 0 and "✓ two and two make four" in ran.stdout, ran.stdout + ran.stderr

    listed = run_in(project, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                    "-o", "addopts=", "tests/test_browser.py")
    assert "test_notebook_runs_in_jupyterlab[99_throwaway.ipynb]" in listed.stdout, listed.stdout + listed.stderr
    expected = run_in(project, "-c", "from ddp_helpers.course.manifest import lessons; print(lessons()['99'].browser)")
    assert "two and two make four" in expected.stdout, expected.stderr

    ledger = ["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_project.py",
              "-k", "every_check_in_the_lessons"]
    held = run_in(project, *ledger)
    assert held.returncode == 0, held.stdout[-3000:]
    (project / "ddp_helpers" / "course" / "lessons" / "lesson99" / "checks.md").write_text("# no lines\n")
    caught = run_in(project, *ledger)
    assert caught.returncode != 0 and "lesson99/checks.md: add - `c0ffee00` \"two and two make four\"" in caught.stdout, \
        caught.stdout[-3000:]


def test_a_broken_manifest_names_its_file(tmp_path):
    (tmp_path / "lesson.toml").write_text("number = 3\n")  # no notebook, no checker
    with pytest.raises(ValueError, match=r"lesson\.toml: not a lesson manifest \(KeyError: 'notebook'\)"):
        read_manifest(tmp_path / "lesson.toml")
    (tmp_path / "lesson.toml").write_text(textwrap.dedent("""\
        number = 3
        notebook = "03_x.ipynb"
        checker = ":check"
        [browser]
        plot = 2
        """))
    with pytest.raises(ValueError, match="unexpected keyword argument 'plot'"):
        read_manifest(tmp_path / "lesson.toml")


def test_the_course_is_lessons_0_to_7_with_deep_dives_beside_them():
    """The core path is lessons 0 to 7 in order; a deep dive follows its lesson ("2b" after "2"), has a notebook
    named after it, and is found by the runner by its key whichever way it is typed."""
    course = lessons()
    assert [key for key, lesson in course.items() if not lesson.deep_dive] == [str(n) for n in range(8)]
    keys = list(course)
    for key, lesson in course.items():
        if lesson.deep_dive:
            assert keys.index(key) > keys.index(str(lesson.number)), f"deep dive {key} comes before its lesson"
            assert lesson.notebook.startswith(f"{lesson.number:02d}{lesson.part}_"), lesson.notebook
            for typed in (key, f"{lesson.number:02d}{lesson.part}", key.upper()):
                assert find_lesson(typed, NOTEBOOKS) == NOTEBOOKS / lesson.notebook, typed
    assert "2b" in course, "lesson 2's deep dive"


def test_a_deep_dive_part_is_one_letter(tmp_path):
    (tmp_path / "lesson.toml").write_text('number = 2\npart = "bb"\nnotebook = "02bb_x.ipynb"\n')
    with pytest.raises(ValueError, match="one lower-case letter"):
        read_manifest(tmp_path / "lesson.toml")
    (tmp_path / "lesson.toml").write_text('number = 2\nnotebook = "02_x.ipynb"\n')  # a core lesson needs its exercise
    with pytest.raises(ValueError, match="KeyError: 'checker'"):
        read_manifest(tmp_path / "lesson.toml")
