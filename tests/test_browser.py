"""The JupyterLab walkthrough in a real browser: every notebook run through JupyterLab's own UI in
headless Chromium (Debian's `chromium` package, driven by Playwright; nothing downloads a browser).

For each notebook: all cells run with no error output, per-rank output shows, plot images render,
widgets render as widgets (not their text form), and moving a slider redraws its plot. A screenshot
per notebook lands in test-artifacts/screenshots/, and the notebook as JupyterLab saved it after the
run (every output) in test-artifacts/executed/. JupyterLab runs on 127.0.0.1, a free port, with a
token and temporary settings, on a copy of the notebooks (it autosaves what it runs), and is shut
down at the end with nothing of it left running.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from ddp_helpers.course.manifest import BrowserExpectation, lessons
from ddp_helpers.processes import kill_marked, marked_processes
from ddp_helpers.engines.local.zygote import SUPERVISOR_STOP_S
from support import course_notebooks, free_port

ROOT = Path(__file__).resolve().parent.parent
# The notebook on screen (other open documents are hidden panels).
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
NOTEBOOKS = course_notebooks()
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
EXECUTED = ROOT / "test-artifacts" / "executed"
# The README's picture: lesson 5's first hang as JupyterLab shows it, taken afresh by every run of the test.
README_PICTURE = ROOT / "docs" / "hang_report.png"
FRESH_PICTURE = ROOT / "test-artifacts" / "readme" / "hang_report.png"
PICTURE_HEIGHT = 1100  # pixels of the cell kept from its top: the code, the ranks' lines and the report
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-quic",
]
MARKER_ENV = "DDP_LESSONS_BROWSER_TEST"
# Per lesson, from its manifest (`ddp_helpers/course/lessons/lessonN/lesson.toml`, [browser]): a check its run must
# confirm, the hint its exercise as given gets from the checker (it must be judged, and judged wrong), and how many
# plots must render as images. (This is the suite's one run of each notebook; launch_lesson.sh is tested on a
# small lesson of its own.)
LESSON_EXPECTATIONS = {lesson.notebook: lesson.browser for lesson in lessons().values()}
# Seconds with no cell running and cells left unrun after which Run All has stopped at an error (Run All
# queues every cell at once, so between two cells some cell is always queued or running).
RUN_ALL_STOPPED_S = 4
# Each notebook's test writes here when it is done, with the session's start: the site test, built from the
# notebooks this session saved, waits for all of them (they run on two workers).
ATTEMPTED = ROOT / "test-artifacts" / "attempted"
SITE = ROOT / "test-artifacts" / "site"
NOTEBOOKS_WAIT_S = 1500  # the other chain's notebooks, at most: a whole chain's time and then some
# Text forms that mean a widget did not render as a widget.
WIDGET_TEXT_FORMS = ("IntSlider(", "VBox(children", "sliders need a live Jupyter kernel")


def find_chromium() -> str:
    for candidate in (os.environ.get("CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail(
        "Chromium not found. The browser test needs Debian's `chromium` package: "
        "`sudo apt-get install chromium` (or set CHROMIUM=/path/to/chromium). .ci/run installs it."
    )


# How many ports JupyterLab is started on before the test gives up (each taken by another process meanwhile).
PORT_ATTEMPTS = 5


class PortTaken(AssertionError):
    """JupyterLab exited: the port chosen for it was taken before it could bind it."""


class JupyterLab:
    """A JupyterLab server for the test, with its own settings, runtime folder and marker."""

    def __init__(self, scratch: Path):
        # Serve a copy of the course under test: JupyterLab autosaves the notebooks it runs.
        self.root = scratch / "course"
        shutil.copytree(course_notebooks()[0].parent, self.root / "notebooks")
        self.token = secrets.token_hex(16)
        self.marker = uuid.uuid4().hex
        settings = scratch / "user-settings"
        # The test's own complete settings, whatever the environment ships: every cell stays in the page (no
        # virtual scrolling) so all can be checked; the kernel starts without a "Select Kernel" dialog; no
        # news or update pop-up.
        for path, values in {
            "notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        }.items():
            file = settings / "@jupyterlab" / f"{path}.jupyterlab-settings"
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(values))
        env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(scratch / "config"),
            "JUPYTER_RUNTIME_DIR": str(scratch / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(settings),
            "JUPYTERLAB_WORKSPACES_DIR": str(scratch / "workspaces"),
            MARKER_ENV: self.marker,
        }
        # The port is free when chosen, but any process may take it before JupyterLab binds it (the launches
        # of other tests bind ports the OS picks): JupyterLab then exits saying so, and starts again on another.
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = free_port()
            self.log = open(scratch / "jupyterlab.log", "wb")
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                    "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                    f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                ],
                env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
            self.url = f"http://127.0.0.1:{self.port}"
            try:
                self._wait_until_ready(scratch / "jupyterlab.log")
                return
            except PortTaken:
                self.log.close()
                if attempt == PORT_ATTEMPTS:
                    raise

    def _wait_until_ready(self, log_path: Path, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = log_path.read_text()
                if f"port {self.port} is not available" in log:
                    raise PortTaken(log[-3000:])
                raise AssertionError(f"JupyterLab exited:\n{log[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"JupyterLab did not answer within {timeout_s} s:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> list[int]:
        """SIGTERM (JupyterLab shuts its kernels down), then SIGKILL; return what was still running."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        # A shut-down kernel's warm process first lets each run's supervisor stop its run (SUPERVISOR_STOP_S):
        # what is still winding down then is not left behind. What outlives that is, named by its command line.
        deadline = time.monotonic() + SUPERVISOR_STOP_S + 5
        while (survivors := marked_processes(self.marker, MARKER_ENV)) and time.monotonic() < deadline:
            time.sleep(0.2)
        described = [f"{pid}: {_command_line(pid)}" for pid in survivors]
        kill_marked(self.marker, MARKER_ENV)
        return described


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


@pytest.fixture(scope="module")
def chromium_path():
    return find_chromium()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium_path):
    server = JupyterLab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(chromium_path, lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def prompts_js(body: str) -> str:
    return (
        "() => { const prompts = [...document.querySelectorAll('PANEL .jp-CodeCell .jp-InputArea-prompt')]"
        ".map(p => p.textContent.trim()); "
        + body + " }"
    ).replace("PANEL", PANEL)


def run_all_cells(page, stuck_after_s: float = 300, timeout_s: float = 1200) -> None:
    """Run All, then wait until every code cell has an execution count, or Run All stopped at an error.

    Fails when no cell finishes for `stuck_after_s` (every lesson cell bounds its own run with a timeout
    of at most two minutes), or after `timeout_s` in all: a whole notebook's time depends on the load.
    A kernel that is still connecting can drop some or all of a Run All (seen on fresh environments:
    no cell ran, or only the first). When nothing runs while cells are left unrun, ask again."""
    state_js = prompts_js(
        "return {total: prompts.length, unrun: prompts.filter(t => t === '[ ]:').length,"
        " running: prompts.filter(t => t === '[*]:').length};"
    )
    deadline = time.monotonic() + timeout_s
    requests, stalled_since = 0, time.monotonic()
    finished, last_progress = -1, time.monotonic()
    while True:
        ran = state["total"] - state["unrun"] - state["running"] if requests else 0
        # Ask again only while at most the first cell ran: asking once cells have run would run them twice.
        if requests == 0 or (requests < 4 and ran <= 1 and time.monotonic() - stalled_since > 15):
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            requests, stalled_since = requests + 1, time.monotonic()
        state = page.evaluate(state_js)
        if state["total"] and not state["unrun"] and not state["running"]:
            return
        # A cell that raised ends Run All: the cells after it stay unrun, and none is queued. The saved
        # notebook says which cell and what it raised.
        if (ran > 1 or requests == 4) and not state["running"] and time.monotonic() - stalled_since > RUN_ALL_STOPPED_S:
            return
        if state["total"] - state["unrun"] - state["running"] != finished:
            finished, last_progress = state["total"] - state["unrun"] - state["running"], time.monotonic()
        if time.monotonic() - last_progress > stuck_after_s:
            raise AssertionError(f"no cell finished for {stuck_after_s} s ({requests} Run All requests): {state}")
        if time.monotonic() > deadline:
            raise AssertionError(f"cells not all run after {timeout_s} s ({requests} Run All requests): {state}")
        if state["running"]:
            stalled_since = time.monotonic()
        time.sleep(0.5)


def saved_notebook(page, path: Path, timeout_s: float = 30) -> dict:
    """Save the notebook on screen (Ctrl+S) and read it back from disk.

    The page cannot tell an error from other stderr: JupyterLab renders an error output with the
    stderr renderer. The saved file keeps each output's type."""
    before = path.stat().st_mtime_ns
    page.locator(f"{PANEL} .jp-Notebook").press("Control+s")
    deadline = time.monotonic() + timeout_s
    while path.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"JupyterLab did not save {path.name} within {timeout_s} s of Ctrl+S")
        time.sleep(0.2)
    # JupyterLab writes the file in one go, but read until it parses, in case the save is still landing.
    while True:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def cells_that_failed_or_never_ran(notebook: dict) -> list[str]:
    """Each code cell that has an error output or no execution count, with what it raised."""
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        label = f"cell {index} ({cell.get('id')})"
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.get("traceback", [])))
                problems.append(f"{label} raised {output['ename']}: {traceback[-1500:]}")
        if cell.get("execution_count") is None:
            problems.append(f"{label} never ran")
    return problems


def open_notebook(page, lab, name: str) -> None:
    """Open notebooks/<name> in a workspace of its own, reset: only it is open, whatever ran before."""
    page.goto(f"{lab.url}/lab/workspaces/{Path(name).stem}/tree/notebooks/{name}?reset&token={lab.token}")
    page.wait_for_selector(f"{PANEL} .jp-CodeCell", timeout=90_000)
    # The execution indicator says "idle" while the notebook has no kernel yet, and a Run All then is
    # dropped: wait for the toolbar to name a kernel, and for that kernel to be idle.
    page.wait_for_function(
        "(panel) => { const name = document.querySelector(panel + ' .jp-Toolbar-kernelName');"
        " const status = document.querySelector(panel + ' .jp-Notebook-ExecutionIndicator');"
        " return name && status && !['No Kernel', 'Kernel'].includes(name.getAttribute('aria-label'))"
        " && status.dataset.status === 'idle'; }",
        arg=PANEL, timeout=90_000,
    )


def output_texts(page) -> list[str]:
    return page.locator(f"{PANEL} .jp-OutputArea-output").all_inner_texts()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_jupyterlab(browser, lab, notebook):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, notebook.name)
        run_all_cells(page)
        problems = cells_that_failed_or_never_ran(saved_notebook(page, lab.root / "notebooks" / notebook.name))
        # The run as JupyterLab saved it, outputs included: every output a learner saw, to read afterwards.
        EXECUTED.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lab.root / "notebooks" / notebook.name, EXECUTED / notebook.name)
        assert not problems, f"{notebook.name}:\n" + "\n---\n".join(problems)[:4000]

        texts = output_texts(page)
        assert "Would you like to get notified" not in page.content(), "JupyterLab's news pop-up should be off"
        joined = "\n".join(texts)
        assert "[rank 0]" in joined and "[rank 1]" in joined, "per-rank output should show in the page"
        for text_form in WIDGET_TEXT_FORMS:
            assert text_form not in joined, f"a widget rendered as text ({text_form!r})"

        images = page.locator(f"{PANEL} .jp-OutputArea-output img")
        rendered = page.evaluate(
            "(panel) => [...document.querySelectorAll(panel + ' .jp-OutputArea-output img')]"
            ".filter(i => i.naturalWidth > 100).length",
            PANEL,
        )
        if not notebook.name.startswith("02_"):  # lesson 2's widget images are redrawn as the test moves them
            assert images.count() == rendered, "every image in an output should load"
        expected = LESSON_EXPECTATIONS.get(notebook.name, BrowserExpectation())
        confirmed, judged, plot_count = expected.confirmed, expected.judged, expected.plots
        assert rendered >= plot_count, f"expected the lesson's {plot_count} plots as images, {rendered} rendered"
        if confirmed:
            assert confirmed in joined, f"the lesson's check should confirm {confirmed!r}"
        if judged:
            assert judged in joined, f"the exercise as given should be judged wrong with {judged!r}"
        if notebook.name.startswith("02_"):
            check_widgets(page)
        check_line_numbers(page)
        if notebook.name.startswith("05_"):
            check_readme_picture(page)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{notebook.stem}.png"))
    except Exception:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{notebook.stem}-failed.png"))
        prompts = page.locator(f"{PANEL} .jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        print(f"{notebook.name} prompts when it failed: {prompts}")
        print("outputs:\n" + "\n---\n".join(output_texts(page))[-6000:])
        raise
    finally:
        page.close()
        # Done with this notebook, saved or not: the site test (on the other chain, maybe) waits for every one.
        ATTEMPTED.mkdir(parents=True, exist_ok=True)
        (ATTEMPTED / notebook.name).write_text(os.environ.get("DDP_LESSONS_SESSION_STARTED", ""))


def check_line_numbers(page) -> None:
    """Code cells show their line numbers (the project's settings turn them on): the lines a hang report,
    a traceback or a hint names, counted from the %%torchrun line as 1, are the lines on screen."""
    numbers = page.evaluate(
        "(panel) => { const cell = [...document.querySelectorAll(panel + ' .jp-CodeCell')]"
        ".find(c => c.querySelector('.cm-content')?.innerText.startsWith('%%torchrun'));"
        " if (!cell) return null;"
        " return [...cell.querySelectorAll('.cm-lineNumbers .cm-gutterElement')]"
        ".filter(e => getComputedStyle(e).visibility !== 'hidden').map(e => e.innerText); }",
        PANEL,
    )
    assert numbers, "a %%torchrun cell should show line numbers (jupyter/overrides.json's codeCellConfig)"
    assert numbers[:3] == ["1", "2", "3"], f"its lines should be numbered from the %%torchrun line: {numbers[:5]}"


def check_readme_picture(page) -> None:
    """Take the README's picture afresh (lesson 5's first hang: the cell, with its line numbers, and the report
    naming the line of the cell), and hold the committed one to it: a picture whose size no longer matches
    shows a report that changed. To refresh it, copy test-artifacts/readme/hang_report.png to docs/."""
    from PIL import Image

    cell = page.locator(f"{PANEL} .jp-CodeCell").filter(has_text="%%torchrun --name skipped").first
    cell.scroll_into_view_if_needed()
    FRESH_PICTURE.parent.mkdir(parents=True, exist_ok=True)
    cell.screenshot(path=str(FRESH_PICTURE))
    with Image.open(FRESH_PICTURE) as whole:
        whole.crop((0, 0, whole.width, min(whole.height, PICTURE_HEIGHT))).save(FRESH_PICTURE)
    shown = "\n".join(output_texts(page))
    assert "What each rank was waiting in when the run timed out" in shown and "of the cell" in shown
    assert README_PICTURE.exists(), f"the README's picture is missing: copy {FRESH_PICTURE} to {README_PICTURE}"
    with Image.open(README_PICTURE) as committed, Image.open(FRESH_PICTURE) as fresh:
        assert committed.format == "PNG"
        assert abs(committed.width - fresh.width) <= 0.1 * fresh.width and \
            abs(committed.height - fresh.height) <= 0.15 * fresh.height, (
                f"{README_PICTURE} ({committed.size}) no longer matches the report as it shows now ({fresh.size}): "
                f"copy {FRESH_PICTURE} over it")


def check_widgets(page) -> None:
    sliders = page.locator(".widget-slider")
    assert sliders.count() >= 2, "the partition explorer's sliders should render as widgets"
    assert page.locator(".widget-radio-box").count() >= 4, "the quiz's options should render as widgets"

    # The quiz answers at once.
    first_question = page.locator(".widget-vbox", has=page.locator(".widget-radio-box")).nth(1)
    first_question.locator("label", has_text="128 samples").click()
    first_question.locator("button", has_text="Check").click()
    page.wait_for_function("() => document.body.innerText.includes('Right. DDP averages')", timeout=10_000)

    # Moving the world-size slider redraws the partition plot.
    explorer_image = page.locator(".widget-output img").first
    explorer_image.scroll_into_view_if_needed()
    before = explorer_image.get_attribute("src")
    handle = sliders.first.locator(".noUi-handle")
    handle.click()
    handle.press("ArrowRight")
    page.wait_for_function(
        "(before) => { const img = document.querySelector('.widget-output img'); return img && img.src !== before; }",
        arg=before, timeout=20_000,
    )
    assert sliders.first.locator(".widget-readout").inner_text().strip() == "3"

    # The button re-runs step 7 on the chosen 3 ranks and draws what they recorded.
    before = explorer_image.get_attribute("src")
    page.locator("button", has_text="Re-run step 7 on these ranks").click()
    page.wait_for_function("() => document.body.innerText.includes('ran on 3 ranks')", timeout=60_000)
    page.wait_for_function(
        "(before) => { const img = document.querySelector('.widget-output img'); return img && img.src !== before; }",
        arg=before, timeout=20_000,
    )


def test_a_failed_check_is_caught_and_named(browser, lab):
    """The error assertion above can fail: a lesson check that fails stops Run All, and the test names the
    cell and the check's message, and the cell after it as never run."""
    import nbformat

    cells = ["print('before')",
             "from ddp_helpers.course.checks import check\ncheck(False, 'never printed', 'broken on purpose')",
             "print('after')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbformat.write(notebook, lab.root / "notebooks" / "broken.ipynb")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, "broken.ipynb")
        run_all_cells(page)
        problems = cells_that_failed_or_never_ran(saved_notebook(page, lab.root / "notebooks" / "broken.ipynb"))
    finally:
        page.close()
    assert problems, "the failed check was not reported"
    failure, *after = problems
    assert failure.startswith("cell 1 (") and "LessonCheckFailed" in failure and "broken on purpose" in failure, problems
    # Run All sends every cell's request at once and the kernel drops those queued behind the error; a
    # request that reaches ipykernel after the drop still runs (seen once under load), so cell 2 may
    # have run. That the helper names a cell that never ran is tested without a browser, below.
    assert len(after) <= 1 and all(p.startswith("cell 2 (") and p.endswith("never ran") for p in after), problems


STOP_ME = """%%torchrun -n 2 --backend gloo --name stop_me --timeout 120
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
print("in the hang", flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(4))  # rank 1 never calls it
time.sleep(300)
"""


def test_jupyterlabs_stop_button_shows_where_each_rank_was(browser, lab):
    """Stop (JupyterLab's interrupt) pressed long before the cell's timeout: the cell prints the same report a
    timeout gives, what each rank was waiting in, then ends."""
    import nbformat

    cells = ["%load_ext ddp_helpers", STOP_ME]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbformat.write(notebook, lab.root / "notebooks" / "stop.ipynb")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, "stop.ipynb")
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        started = time.monotonic()
        page.wait_for_function(
            "(panel) => [...document.querySelectorAll(panel + ' .jp-OutputArea-output')]"
            ".filter(o => o.innerText.includes('in the hang')).length > 0", arg=PANEL, timeout=90_000)
        time.sleep(1)  # both ranks in the hang: rank 0 in its all_reduce
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Interrupt Kernel$")).click()
        page.wait_for_function(
            "(panel) => [...document.querySelectorAll(panel + ' .jp-OutputArea-output')]"
            ".some(o => o.innerText.includes('when the run was stopped'))", arg=PANEL, timeout=60_000)
        shown = "\n".join(output_texts(page))
    finally:
        page.close()
    assert time.monotonic() - started < 90, "stopped long before the cell's 120 s timeout"
    assert "What each rank was waiting in when the run was stopped" in shown and "all_reduce" in shown, shown
    assert "Rank 1 never called all_reduce" in shown, shown


def test_a_cell_that_never_ran_is_named():
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)", execution_count=1),
                                               nbformat.v4.new_markdown_cell("text"),
                                               nbformat.v4.new_code_cell("print(2)")])
    notebook.cells[0].id, notebook.cells[2].id = "first", "second"
    assert cells_that_failed_or_never_ran(notebook) == ["cell 2 (second) never ran"]


def test_jupyterlab_shuts_down_leaving_no_process(lab, browser):
    survivors = lab.stop()
    assert survivors == [], f"processes of the JupyterLab run still alive after shutdown: {survivors}"


def test_the_site_built_from_these_runs_reads_as_the_lessons_did(browser, request):
    """The course's static site (website/build.py, `scripts/build_site.sh`), built from the notebooks this module's
    JupyterLab runs saved, and read page by page in Chromium: no console error and no request beyond the site; every
    image loaded; every link inside the site leads to a page; each lesson shows its ranks in their colours, the ✓
    check and the plots its run made, with how to run it and what its outputs were made on; lesson 5 its hang
    report; no traceback but in the cells that fail on purpose, and those marked; every solution folded; and the
    search finds lesson 2 for set_epoch."""
    import functools
    import http.server
    import threading
    import urllib.parse

    from ddp_helpers.output import rank_color

    names = {notebook.name for notebook in NOTEBOOKS}
    session = os.environ.get("DDP_LESSONS_SESSION_STARTED", "")
    runs_them = {item.callspec.params["notebook"].name for item in request.session.items
                 if item.originalname == "test_notebook_runs_in_jupyterlab"}
    if runs_them != names:
        pytest.skip("the site is built from the notebooks this session's JupyterLab runs saved: run the whole module")
    deadline = time.monotonic() + NOTEBOOKS_WAIT_S
    done = lambda name: (ATTEMPTED / name).is_file() and (ATTEMPTED / name).read_text() == session  # noqa: E731
    while not all(done(name) for name in names):
        assert time.monotonic() < deadline, f"notebooks never done: {sorted(n for n in names if not done(n))}"
        time.sleep(2)
    stale = sorted(name for name in names if not (EXECUTED / name).is_file()
                   or (EXECUTED / name).stat().st_mtime < float(session))
    assert not stale, f"no notebook saved by this session's JupyterLab for {stale}: their tests above say why"
    began = time.monotonic()
    subprocess.run([sys.executable, str(ROOT / "website" / "build.py"), "--executed", str(EXECUTED), "--out", str(SITE)],
                   check=True, timeout=300)
    print(f"site built in {time.monotonic() - began:.1f} s")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}/"
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems: list[str] = []
    page.on("console", lambda message: problems.append(f"console: {message.text}") if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("request", lambda request: None if request.url.startswith(base) or request.url.startswith("data:")
            else problems.append(f"a request beyond the site: {request.url}"))
    rgb = lambda hex_color: "rgb({},{},{})".format(*(int(hex_color[i:i + 2], 16) for i in (1, 3, 5)))  # noqa: E731
    try:
        pages = ["index.html", "reference.html"] + [f"lessons/{Path(n).stem}.html" for n in LESSON_EXPECTATIONS]
        links = set()
        for path in pages:
            page.goto(base + path)
            page.wait_for_load_state("networkidle")
            assert page.evaluate("() => [...document.images].every(i => i.complete && i.naturalWidth > 0)"), \
                f"{path}: an image did not load"
            for href in page.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.href)"):
                if href.startswith(base):
                    links.add(urllib.parse.urlsplit(href).path.lstrip("/"))
            text = page.inner_text("body")
            if path.startswith("lessons/"):
                expected = LESSON_EXPECTATIONS[Path(path).stem + ".ipynb"]
                for rank in (0, 1):
                    assert page.locator(f'span[style*="{rgb(rank_color(rank))}"]', has_text=f"[rank {rank}]").count(), \
                        f"{path}: rank {rank}'s output should show in its colour"
                assert "Run it yourself" in text and "The outputs below were made on" in text, path
                if expected.confirmed:
                    assert expected.confirmed in " ".join(text.split()), f"{path}: its check {expected.confirmed!r}"
                plots = page.locator(".cell_output img").count()
                assert plots >= expected.plots, f"{path}: {expected.plots} plots expected, {plots} shown"
                unmarked = page.evaluate(
                    "() => [...document.querySelectorAll('div.cell')].filter(c => c.innerText.includes("
                    "'Traceback (most recent call last)') && !c.querySelector('.fails-on-purpose'))"
                    ".map(c => c.innerText.slice(0, 200))")
                assert not unmarked, f"{path}: a traceback in a cell not marked as failing on purpose: {unmarked}"
                assert page.evaluate("() => [...document.querySelectorAll('details')].every(d => !d.open)"), \
                    f"{path}: a solution or answer shown unfolded"
            if path.startswith("lessons/05_"):
                assert "What each rank was waiting in when the run timed out" in text, "lesson 5's hang report"
        missing = sorted(link for link in links if not (SITE / (link or "index.html")).is_file()
                         and not (SITE / link / "index.html").is_file())
        assert not missing, f"links inside the site that lead nowhere: {missing}"
        page.goto(base + "search.html?q=set_epoch")
        page.wait_for_selector("#search-results li a", timeout=20_000)
        found = page.evaluate("() => [...document.querySelectorAll('#search-results li a')].map(a => a.href)")
        assert any("02_ddp_basics" in href for href in found), f"the search for set_epoch found {found}"
        assert not problems, "\n".join(problems)
    finally:
        page.close()
        server.shutdown()
        server.server_close()
