"""Build the course's static site: every lesson and deep dive with the outputs of a real run, a landing page and
the launcher's reference, as HTML any static host serves (`scripts/build_site.sh`).

The notebooks come executed: by the suite's browser test (JupyterLab saves them in test-artifacts/executed/), or,
on a fresh clone with none at hand, by this script first (`--execute-missing`: each lesson as nbmake runs it, a few
minutes for the course). Sphinx renders them and runs nothing. Before it does, each notebook is prepared for a
reader without a kernel (`prepare`): each rank's coloured output kept in its colours, the quiz shown as its
questions with the answers folded, other widgets replaced by a note that they need JupyterLab, the cells that fail
on purpose marked as such, and at the top how to run the lesson and when and on what its outputs were made.

Usage: python website/build.py [--executed DIR] [--out DIR] [--execute-missing]
"""

from __future__ import annotations

import argparse
import datetime
import html
import importlib
import importlib.metadata
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the course's manifests and quiz modules, from this checkout

from ddp_helpers.course.manifest import lessons  # noqa: E402
from ddp_helpers.course.quiz import static_html  # noqa: E402

HERE = Path(__file__).resolve().parent
WIDGET = "application/vnd.jupyter.widget-view+json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RUN_LINE = re.compile(r"(\d+) rank\(s\), backend (\w+)")
FAILS_ON_PURPOSE = ('<div class="fails-on-purpose"><b>This cell fails on purpose.</b> The lesson runs it to show '
                    'the failure; what it means is in the text around it.</div>')
WIDGET_NOTE = ('<div class="widget-note">An interactive widget is here in the notebook (sliders, buttons): open the '
               'lesson in JupyterLab to use it.</div>')


def _html_output(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("display_data", data={"text/html": text})


def _rank_output(text: str) -> nbformat.NotebookNode:
    """A stream with ANSI colours (each rank's `[rank N]` prefix) as HTML in the same colours."""
    from nbconvert.filters.ansi import ansi2html

    return _html_output(f'<pre class="rank-output">{ansi2html(text)}</pre>')


def _output_text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    return output.get("data", {}).get("text/plain", "") if isinstance(output.get("data"), dict) else ""


def _quiz_questions(lesson):
    return importlib.import_module(f"{lesson.package}.{lesson.quiz}").QUESTIONS


def provenance(nb, executed_at: float) -> str:
    """When and on what the outputs were made: the file's date, this environment's torch (which ran them), and the
    backend and world size of the lesson's first launch."""
    searched = (RUN_LINE.search(ANSI.sub("", _output_text(o))) for cell in nb.cells if cell.cell_type == "code"
                for o in cell.get("outputs", []))
    found = next((match for match in searched if match), None)
    on = "no launch"
    if found:
        ranks, backend = found.groups()
        on = f"{ranks} {'CPU processes' if backend == 'gloo' else 'GPUs'} ({backend})"
    day = datetime.datetime.fromtimestamp(executed_at, datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"The outputs below were made on {day}, with torch {importlib.metadata.version('torch')}, on {on}."


def how_to_run(lesson) -> str:
    return (f"**Run it yourself**: `scripts/launch_lesson.sh {lesson.key}` runs it in a terminal, or open "
            f"`notebooks/{lesson.notebook}` in JupyterLab (`.venv/bin/jupyter lab notebooks/`); the README's two "
            "commands set everything up. No GPU needed.")


def prepare(nb, lesson, executed_at: float):
    """The executed notebook `nb` of `lesson`, made readable without a kernel (see the module's docstring)."""
    made = provenance(nb, executed_at)  # read from the outputs as they ran, before any is rewritten
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET in data:
                if "show_quiz(" in cell.source:
                    outputs.append(_html_output(static_html(_quiz_questions(lesson))))
                else:
                    outputs.append(_html_output(WIDGET_NOTE))
            elif output.get("output_type") == "stream" and ANSI.search(output.get("text", "")):
                outputs.append(_rank_output(output["text"]))
            else:
                outputs.append(output)
        failed = any("Traceback (most recent call last)" in ANSI.sub("", _output_text(o))
                     or o.get("output_type") == "error" for o in cell.get("outputs", []))
        # A %%torchrun cell that may fail, or a cell the lesson tags as failing on purpose (one that shows what a
        # failing torchrun prints).
        on_purpose = "--may-fail" in cell.source.split("\n", 1)[0] or "fails-on-purpose" in cell.metadata.get("tags", [])
        if failed and on_purpose:
            outputs.insert(0, _html_output(FAILS_ON_PURPOSE))
        cell.outputs = outputs
    intro = nbformat.v4.new_markdown_cell(how_to_run(lesson) + "\n\n" + made)
    nb.cells.insert(1, intro)
    return nb


def landing_page(all_lessons) -> str:
    readme = (ROOT / "README.md").read_text()
    intro = readme.split("\n\n", 2)[1]  # the paragraph under the title
    rows = lambda deep: "\n".join(  # noqa: E731
        f"| {lesson.key} | [{_title(lesson)}](lessons/{Path(lesson.notebook).stem}) | {lesson.summary} | {lesson.time} |"
        for lesson in all_lessons if lesson.deep_dive == deep)
    head = "| # | lesson | in one line | time |\n|---|---|---|---|\n"
    toctree = "\n".join(f"lessons/{Path(lesson.notebook).stem}" for lesson in all_lessons)
    return f"""# DDP Lessons

{intro}

Every page below is a lesson as it ran: the ranks' own output, the ✓ checks it passed, its plots.

![Lesson 5 in JupyterLab: a run that hangs, stopped by its timeout, and the report of what each rank was waiting in](_static/hang_report.png)

*A hang, found for you: lesson 5 in JupyterLab after its run.*

## Start here

Linux (or WSL) with Python 3.10 or newer; no GPU needed. The first command sets everything up and runs lesson 0 in
the terminal; the second opens the course in JupyterLab:

```bash
scripts/launch_lesson.sh 0
.venv/bin/jupyter lab notebooks/
```

## The core path

Lessons 0 to 7, in order, each finished in a sitting (times: the whole notebook on 2 CPU cores).

{head}{rows(False)}

## Deep dives

Beside a lesson, for whoever wants the depth; the core path never needs them.

{head}{rows(True)}

The launcher the course is built on can be used on its own: [its reference](reference).

```{{toctree}}
:hidden:
:maxdepth: 1

{toctree}
reference
```
"""


def _title(lesson) -> str:
    nb = nbformat.read(ROOT / "notebooks" / lesson.notebook, as_version=4)
    first = next(c.source for c in nb.cells if c.cell_type == "markdown")
    return first.split("\n", 1)[0].lstrip("# ").strip()


REFERENCE = """# The launcher's reference

`ddp_helpers` runs a script, or a notebook cell, on every rank under `torchrun` and reads back what each rank did.
The course is one of its clients; it works without the course (`%load_ext ddp_helpers`).

## The `%%torchrun` cell magic

```text
{magic_help}
```

## From Python

```{{eval-rst}}
.. autofunction:: ddp_helpers.run_script

.. autofunction:: ddp_helpers.launch_options.make_launch_config

.. autoclass:: ddp_helpers.result.RunResult
   :members:

.. autoclass:: ddp_helpers.result.RankResult
   :members:
```

## In the script, on each rank

```{{eval-rst}}
.. autofunction:: ddp_helpers.record

.. autofunction:: ddp_helpers.rank_secret
```

The launcher's guide, with what each option is for, is `docs/launcher.md` in the repository.
"""


def _magic_help() -> str:
    from ddp_helpers.magic import TorchrunMagics

    import textwrap

    text = (TorchrunMagics.torchrun.__doc__ or "").strip()
    return textwrap.dedent(text.removeprefix("::")).strip()  # IPython's usage text is a reST literal block


def execute(notebook: Path, into: Path) -> None:
    """Run one lesson as nbmake does (a kernel, every cell in order) and save it with its outputs."""
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
    nbformat.write(nb, into / notebook.name)


def build(executed: Path, out: Path, execute_missing: bool = False) -> Path:
    all_lessons = list(lessons().values())
    missing = [lesson for lesson in all_lessons if not (executed / lesson.notebook).is_file()]
    if missing and not execute_missing:
        raise SystemExit(f"no executed notebook in {executed} for {', '.join(lesson.key for lesson in missing)}: run the "
                         "suite's browser test, or add --execute-missing to run them here first")
    if missing:
        executed.mkdir(parents=True, exist_ok=True)
        print(f"Running {len(missing)} lesson(s) first, as nbmake would (about half a minute each on 2 cores; "
              "lesson 4b longer)...", flush=True)
        for lesson in missing:
            began = time.perf_counter()
            execute(ROOT / "notebooks" / lesson.notebook, executed)
            print(f"  {lesson.key}: {time.perf_counter() - began:.0f} s", flush=True)
    if (out / ".buildinfo").is_file():  # an earlier build of the site (Sphinx's mark): built afresh, not on top
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory(prefix="ddp-lessons-site-") as folder:
        source = Path(folder) / "site"
        shutil.copytree(HERE, source, ignore=shutil.ignore_patterns("build.py", "__pycache__"))
        shutil.copy(ROOT / "docs" / "hang_report.png", source / "_static" / "hang_report.png")
        (source / "index.md").write_text(landing_page(all_lessons))
        (source / "reference.md").write_text(REFERENCE.format(magic_help=_magic_help()))
        (source / "lessons").mkdir()
        for lesson in all_lessons:
            path = executed / lesson.notebook
            nb = prepare(nbformat.read(path, as_version=4), lesson, path.stat().st_mtime)
            nbformat.write(nb, source / "lessons" / lesson.notebook)
        from sphinx.cmd.build import build_main

        status = build_main(["-b", "html", "-q", "-W", "--keep-going", str(source), str(out)])
        if status:
            raise SystemExit(f"Sphinx failed ({status}): its warnings are above")
    return out / "index.html"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executed", type=Path, default=ROOT / "test-artifacts" / "executed",
                        help="the executed notebooks (default: the browser test's, test-artifacts/executed)")
    parser.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "site", help="the site's folder")
    parser.add_argument("--execute-missing", action="store_true",
                        help="run the lessons that have no executed notebook first")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    index = build(args.executed, args.out, args.execute_missing)
    print(f"The site is in {args.out} ({time.perf_counter() - began:.0f} s): open {index}, or serve the folder "
          "with any static host (python -m http.server --bind 127.0.0.1 -d FOLDER)")


if __name__ == "__main__":
    main()
