"""Multiple-choice questions with immediate feedback (ipywidgets). Without a live frontend (nbmake,
launch_lesson.sh) the questions are printed as text instead, so the notebook still runs.

Options are shown in a shuffled order (fixed per question, so the page is the same on every run):
where the right answer sits says nothing. A wrong pick gets the question's hint, which points at the
idea without naming the answer; the explanation shows only once the answer is right.
"""

from __future__ import annotations

import html
import random
import re
from dataclasses import dataclass

_CODE = re.compile(r"`([^`]+)`")


def as_html(text: str) -> str:
    """Text with markdown's `code` spans, for an HTML widget: escaped, each span in <code>."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def as_option(text: str) -> str:
    """Text with `code` spans, for a radio button (plain text only): each span in quotes, no backticks."""
    return _CODE.sub(lambda m: f"'{m.group(1)}'", text)


@dataclass(frozen=True)
class Question:
    """Args:
        prompt: the question.
        options: the choices, right one included (shown shuffled).
        answer: index of the right option in `options`.
        why: the explanation, shown once the learner picks the right option.
        hint: shown after a wrong pick; it must not give the answer away.
    """

    prompt: str
    options: tuple[str, ...]
    answer: int
    why: str
    hint: str

    @property
    def right_option(self) -> str:
        return self.options[self.answer]

    def shown_options(self) -> list[str]:
        """The options in the order shown: shuffled by a generator seeded from the prompt."""
        order = list(self.options)
        random.Random(self.prompt).shuffle(order)
        return order


def feedback(question: Question, choice: str | None) -> str:
    """What the learner sees after pressing Check with `choice` (an option's text) selected."""
    if choice is None:
        return "Pick an answer first."
    if choice == question.right_option:
        return f"\u2713 Right. {question.why}"
    return f"\u2717 Not quite: try again. Hint: {question.hint}"


def quiz_widget(questions: list[Question]):
    """A box of questions, each with its options and a Check button that shows feedback at once."""
    import ipywidgets as widgets

    rows = []
    for number, question in enumerate(questions, start=1):
        shown_options = question.shown_options()
        # The radio buttons show plain text; each maps back to the option it stands for.
        labels = [(as_option(option), option) for option in shown_options]
        options = widgets.RadioButtons(options=labels, value=None, layout={"width": "max-content"})
        shown = widgets.HTML()
        button = widgets.Button(description="Check", button_style="info")

        def on_click(_, q=question, o=options, f=shown):
            f.value = f"<b>{as_html(feedback(q, o.value))}</b>"

        button.on_click(on_click)
        rows.append(widgets.VBox([widgets.HTML(f"<b>{number}. {as_html(question.prompt)}</b>"), options, button, shown]))
    return widgets.VBox(rows)


def show_quiz(questions: list[Question]) -> None:
    """Display the quiz. Where widgets cannot render (nbmake, a terminal), the questions show as text."""
    from .widgets import display_with_fallback

    as_text = "\n\n".join(
        f"{n}. {q.prompt}\n" + "\n".join(f"   ( ) {option}" for option in q.shown_options())
        for n, q in enumerate(questions, start=1)
    )
    display_with_fallback(quiz_widget(questions), {"text/plain": as_text})


def static_html(questions: list[Question]) -> str:
    """The quiz for a page without a kernel (the course's static site): each question with its options in the
    order shown, and the answer with its explanation folded away until the reader opens it."""
    parts = ['<div class="quiz-static">']
    for number, question in enumerate(questions, start=1):
        options = "".join(f"<li>{as_html(option)}</li>" for option in question.shown_options())
        parts.append(f"<p><b>{number}. {as_html(question.prompt)}</b></p><ul>{options}</ul>"
                     f"<details><summary>Answer</summary><p>{as_html(question.right_option)}. "
                     f"{as_html(question.why)}</p></details>")
    parts.append("</div>")
    return "".join(parts)
