"""Multiple-choice questions with immediate feedback (ipywidgets). Without a live frontend (nbmake,
launch_lesson.sh) the questions are printed as text instead, so the notebook still runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    prompt: str
    options: tuple[str, ...]
    answer: int  # index into options
    why: str


def _feedback(question: Question, choice: int | None) -> str:
    if choice is None:
        return "Pick an answer first."
    if choice == question.answer:
        return f"\u2713 Right. {question.why}"
    return f"\u2717 Not quite: try again. Hint: {question.why.split('.')[0]}."


def quiz_widget(questions: list[Question]):
    """A box of questions, each with its options and a Check button that shows feedback at once."""
    import ipywidgets as widgets

    rows = []
    for number, question in enumerate(questions, start=1):
        options = widgets.RadioButtons(options=list(question.options), value=None, layout={"width": "max-content"})
        feedback = widgets.HTML()
        button = widgets.Button(description="Check", button_style="info")

        def on_click(_, q=question, o=options, f=feedback):
            choice = None if o.value is None else q.options.index(o.value)
            f.value = f"<b>{_feedback(q, choice)}</b>"

        button.on_click(on_click)
        rows.append(widgets.VBox([widgets.HTML(f"<b>{number}. {question.prompt}</b>"), options, button, feedback]))
    return widgets.VBox(rows)


def show_quiz(questions: list[Question]) -> None:
    """Display the quiz. Where widgets cannot render (nbmake, a terminal), the questions show as text."""
    from .widgets import display_with_fallback

    as_text = "\n\n".join(
        f"{n}. {q.prompt}\n" + "\n".join(f"   ( ) {option}" for option in q.options)
        for n, q in enumerate(questions, start=1)
    )
    display_with_fallback(quiz_widget(questions), {"text/plain": as_text})
