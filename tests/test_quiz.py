"""The lessons' quick checks: the answers are out of sight of the notebook's cells, where the right
answer sits says nothing, and a wrong pick never shows the answer."""

import importlib
import json
import re

import pytest

from ddp_helpers.course.manifest import lessons
from ddp_helpers.course.quiz import feedback
from support import course_notebooks

NOTEBOOKS = course_notebooks()
QUESTIONS = importlib.import_module("ddp_helpers.course.lessons.lesson2.quiz").QUESTIONS
EVERY_QUESTION = [q for lesson in lessons().values() for q in lesson.load_quiz()]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_a_quiz_cell_shows_no_answer(notebook):
    cells = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    quiz_cells = [c for c in cells if "show_quiz(" in c]
    assert quiz_cells, f"{notebook.name} has no quiz"
    for cell in quiz_cells:
        assert "Question(" not in cell and re.search(r"from ddp_helpers\.course\.lessons\.lesson\d[a-z]?\.quiz import", cell), cell


def test_the_quiz_covers_the_lessons_traps():
    prompts = " ".join(q.prompt for q in QUESTIONS)
    for topic in ("wraps it in DDP", "DistributedSampler", "barrier", "map_location"):
        assert topic in prompts, f"no question about {topic}"
    # and its deep dive's, beside it
    prompts = " ".join(q.prompt for q in importlib.import_module("ddp_helpers.course.lessons.lesson2b.quiz").QUESTIONS)
    for topic in ("no_sync", "GradScaler", "evaluate"):
        assert topic in prompts, f"no question about {topic}"


def test_the_right_answer_moves_around():
    positions = [q.shown_options().index(q.right_option) for q in QUESTIONS]
    assert len(set(positions)) >= 3, positions
    assert [q.shown_options() for q in QUESTIONS] == [q.shown_options() for q in QUESTIONS], "stable order"


@pytest.mark.parametrize("question", EVERY_QUESTION, ids=lambda q: q.prompt[:40])
def test_a_wrong_pick_gets_a_hint_not_the_answer(question):
    for option in question.options:
        shown = feedback(question, option)
        if option == question.right_option:
            assert shown.startswith("\u2713 Right.") and question.why in shown
        else:
            assert shown.startswith("\u2717 Not quite") and question.hint in shown
            assert question.right_option not in shown and question.why not in shown
    assert feedback(question, None) == "Pick an answer first."


def test_code_in_a_question_shows_as_code_not_backticks():
    """A prompt's `code` renders as <code> in the widget, an option's (plain text) in quotes; the buttons still
    answer with the option itself."""
    from ddp_helpers.course.quiz import quiz_widget

    with_code = [q for q in EVERY_QUESTION if "`" in q.prompt or any("`" in o for o in q.options)]
    assert with_code, "the quizzes name code in some questions"
    box = quiz_widget(with_code)
    for row, question in zip(box.children, with_code):
        prompt, options, _, _ = row.children
        assert "`" not in prompt.value and ("<code>" in prompt.value) == ("`" in question.prompt)
        assert all("`" not in label for label, _ in options.options)
        options.value = question.right_option
        assert feedback(question, options.value).startswith("\u2713 Right.")
