"""The static site's builder (website/build.py), without a browser: what it makes of an executed notebook for a
reader with no kernel, and its refusal when it has no executed notebooks to render. The whole site, built from the
notebooks the suite ran and read in Chromium, is tests/test_browser.py's last test."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "website"))


@pytest.fixture(scope="module")
def build():
    import build as site_build

    return site_build


def lesson(key):
    from ddp_helpers.course.manifest import lessons

    return lessons()[key]


def executed(*cells):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 0. A lesson"), *cells])


def code(source, *outputs):
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = list(outputs)
    return cell


def stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_each_rank_keeps_its_colour_and_the_page_says_how_and_on_what_it_ran(build):
    from ddp_helpers.output import rank_color

    ranks = stream("\x1b[1;38;2;31;119;180m[rank 0]\x1b[0m hello\n\x1b[1;38;2;255;127;14m[rank 1]\x1b[0m hello\n"
                   "2 rank(s), backend gloo, 0.4 s: all ranks finished\n")
    nb = build.prepare(executed(code("%%torchrun --name hello", ranks)), lesson("0"), 1_765_000_000)
    html = nb.cells[2].outputs[0]["data"]["text/html"]
    assert rank_color(0) == "#1f77b4" and "color: rgb(31,119,180)" in html and "color: rgb(255,127,14)" in html
    assert "\x1b" not in html
    intro = nb.cells[1].source
    assert "scripts/launch_lesson.sh 0" in intro and "on 2 CPU processes (gloo)" in intro and "2025-12-06" in intro


def test_the_quiz_shows_its_questions_with_the_answers_folded_and_other_widgets_a_note(build):
    from ddp_helpers.course.lessons.lesson0.quiz import QUESTIONS

    widget = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "VBox(children=...)"})
    nb = build.prepare(executed(code("show_quiz(QUESTIONS)", widget), code("explorer()", widget)), lesson("0"), 0)
    quiz, note = (cell.outputs[0]["data"]["text/html"] for cell in nb.cells[2:])
    first = QUESTIONS[0]
    assert quiz.count("<details>") == len(QUESTIONS) and "VBox" not in quiz
    before_answers = quiz.split("<details>")[0]
    assert first.why.split("`")[0][:30] not in before_answers, "an explanation should be folded away"
    assert "open the lesson in JupyterLab" in note


def test_only_a_failure_the_lesson_runs_on_purpose_is_marked_as_such(build):
    failed = stream("Traceback (most recent call last):\n  File ...\nRuntimeError: boom\n")
    nb = build.prepare(executed(code("%%torchrun --name raises --may-fail", failed), code("1 / 0", failed)),
                       lesson("0"), 0)
    on_purpose, by_mistake = nb.cells[2].outputs, nb.cells[3].outputs
    assert "fails on purpose" in on_purpose[0]["data"]["text/html"] and len(on_purpose) == 2
    assert all("fails on purpose" not in str(output) for output in by_mistake)


def test_without_executed_notebooks_the_build_says_what_to_do_and_makes_nothing(tmp_path):
    out = tmp_path / "site"
    result = subprocess.run([sys.executable, str(ROOT / "website" / "build.py"), "--executed", str(tmp_path / "none"),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--execute-missing" in result.stderr, result.stderr
    assert not out.exists()
