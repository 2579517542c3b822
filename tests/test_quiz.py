"""Lesson 2's quick check, taken from the notebook: where the right answer sits says nothing, and a
wrong pick never shows the answer."""

from pathlib import Path

import nbformat
import pytest

from ddp_helpers import quiz
from ddp_helpers.quiz import feedback

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "02_ddp_basics.ipynb"


def lesson_questions() -> list[quiz.Question]:
    cell = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                if c.cell_type == "code" and "show_quiz(" in c.source)
    captured = []
    namespace = {}
    exec(cell.replace("from ddp_helpers.quiz import Question, show_quiz", ""),
         {"Question": quiz.Question, "show_quiz": captured.extend}, namespace)
    return captured


QUESTIONS = lesson_questions()


def test_the_quiz_covers_the_lessons_traps():
    prompts = " ".join(q.prompt for q in QUESTIONS)
    for topic in ("wraps it in DDP", "DistributedSampler", "barrier", "map_location", "no_sync"):
        assert topic in prompts, f"no question about {topic}"


def test_the_right_answer_moves_around():
    positions = [q.shown_options().index(q.right_option) for q in QUESTIONS]
    assert len(set(positions)) >= 3, positions
    assert [q.shown_options() for q in QUESTIONS] == [q.shown_options() for q in lesson_questions()], "stable order"


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: q.prompt[:40])
def test_a_wrong_pick_gets_a_hint_not_the_answer(question):
    for option in question.options:
        shown = feedback(question, option)
        if option == question.right_option:
            assert shown.startswith("\u2713 Right.") and question.why in shown
        else:
            assert shown.startswith("\u2717 Not quite") and question.hint in shown
            assert question.right_option not in shown and question.why not in shown
    assert feedback(question, None) == "Pick an answer first."
