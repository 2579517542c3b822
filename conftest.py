"""Test-suite wiring for both test folders (tests/ and the notebooks nbmake collects): which course the
tests run, which tests run one after another under pytest-xdist, and which the quick inner loop leaves
out. Fixtures are in tests/conftest.py."""

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ddp_helpers.course.manifest import lessons

ROOT = Path(__file__).resolve().parent
# The folder of notebooks every test runs and checks (nbmake, the browser, the lesson tests): the course
# as git's index holds it, i.e. what is committed plus what a contributor has `git add`ed. A learner's
# JupyterLab autosaves outputs and their own edits into notebooks/: those are neither run nor touched.
COURSE_ENV = "DDP_LESSONS_COURSE_UNDER_TEST"
SESSION_STARTED_ENV = "DDP_LESSONS_SESSION_STARTED"


def _staged_notebooks() -> dict[str, str] | None:
    """{file name: index blob} of notebooks/*.ipynb in git's index; None outside a git checkout."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "--stage", "--", "notebooks"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    staged = {}
    for entry in filter(None, listing.split("\0")):
        info, path = entry.split("\t", 1)
        _mode, blob, stage = info.split()
        if stage == "0" and path.count("/") == 1 and path.endswith(".ipynb"):
            staged[path.split("/", 1)[1]] = blob
    return staged


def _export_course(folder: Path) -> list[str]:
    """Writes the course under test into `folder`; returns the notebooks whose working copy differs."""
    folder.mkdir(parents=True, exist_ok=True)
    staged = _staged_notebooks()
    if staged is None:  # a copy without git (an unpacked archive): its files are the course
        for notebook in (ROOT / "notebooks").glob("*.ipynb"):
            shutil.copyfile(notebook, folder / notebook.name)
        return []
    differ = []
    for name, blob in staged.items():
        content = subprocess.run(["git", "cat-file", "blob", blob], cwd=ROOT, capture_output=True, check=True).stdout
        (folder / name).write_bytes(content)
        working_copy = ROOT / "notebooks" / name
        if not working_copy.is_file() or working_copy.read_bytes() != content:
            differ.append(name)
    differ += sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb") if p.name not in staged)
    return differ


_differing_notebooks: list[str] = []


def pytest_configure(config):
    global _differing_notebooks
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller has set both up, and the environment carries them
    scratch = Path(tempfile.mkdtemp(prefix="ddp-lessons-tests-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ[COURSE_ENV] = str(scratch / "notebooks")
    _differing_notebooks = _export_course(scratch / "notebooks")
    # Cells the tests run write their scripts and runs here, never into the learner's runs/.
    os.environ.setdefault("DDP_HELPERS_RUNS", str(scratch / "runs"))
    # When this session began, for every worker: the site test knows a notebook saved since then from an old one.
    os.environ[SESSION_STARTED_ENV] = repr(time.time())


def pytest_report_header(config):
    if _differing_notebooks:
        return (f"notebooks: testing the course as committed or staged; not tested, as they differ in your working "
                f"tree: {', '.join(_differing_notebooks)} (`git add` a notebook to test your edit)")
    return None


def pytest_ignore_collect(collection_path, config):
    # nbmake collects notebooks/*.ipynb: only those of the course under test (a learner's "Copy1" is not one).
    if collection_path.suffix == ".ipynb" and collection_path.parent == ROOT / "notebooks":
        if not (Path(os.environ[COURSE_ENV]) / collection_path.name).is_file():
            return True
    return None

# pytest-xdist (-n 3 --dist loadgroup): tests in one group run one after another on one worker. A
# notebook run keeps both cores busy for up to a minute, and the lessons time what they show: no more
# than two run at once. The browser test runs the notebooks on two workers (a JupyterLab each), split so
# that the two chains take about as long, by the times the lessons' manifests give; the third worker takes
# the rest (a fourth gained nothing on 2026-12-06: 834 s of pytest with 3 workers and with 4, the suite being
# CPU-bound). Notebooks under nbmake (`--nbmake notebooks/`) go one after another. The Slurm tests share one
# cluster.
SERIAL_GROUPS = {"test_slurm.py": "slurm"}
BROWSER_CHAINS = ("browser-1", "browser-2")
CHAINS_FIRST = (*BROWSER_CHAINS, "nbmake")  # the longest chains start first


def _seconds(time: str) -> float:
    """A manifest's nbmake time ("35 s", "about 105 s", "14–18 s") in seconds, its first number."""
    import re

    found = re.search(r"\d+", time)
    return float(found.group()) if found else 30.0


@functools.cache  # read once, not for each of the browser test's items
def _balanced_chains() -> dict[str, str]:
    """{notebook: chain}: the longest notebooks first, each to the chain that has the less time so far."""
    load = dict.fromkeys(BROWSER_CHAINS, 0.0)
    chains = {}
    for lesson in sorted(lessons().values(), key=lambda lesson: -_seconds(lesson.time)):
        chain = min(load, key=load.get)
        chains[lesson.notebook] = chain
        load[chain] += _seconds(lesson.time) + 10  # each notebook's own JupyterLab tab and kernel start
    return chains


def _browser_chain(item) -> str:
    notebook = getattr(item, "callspec", None) and item.callspec.params.get("notebook")
    # The tests with no notebook (JupyterLab shuts down cleanly; the site, built from both chains' notebooks once
    # they are done) run last on the second chain. A notebook
    # no manifest names (a test's own) goes by its number's parity.
    if notebook is None:
        return BROWSER_CHAINS[1]
    return _balanced_chains().get(notebook.name, BROWSER_CHAINS[int(notebook.name[:2]) % 2])


# The quick inner loop, `scripts/run_tests.sh -m "not slow"`, leaves these out: whole notebooks, the
# browser, the Slurm cluster, and the launches that wait out timers, restarts, cold starts or many runs.
# A lesson's tests are slow where its manifest says so (`ddp_helpers/course/lessons/lessonN/lesson.toml`).
SLOW_FILES = {"test_browser.py", "test_slurm.py", "test_hang.py", "test_exit_abort.py", "test_cleanup.py", "test_agents.py",
              "test_hostile.py", "test_warm.py", "test_launch_lesson.py", "test_without_the_course.py",
              "test_workshop.py"} | {
    test for lesson in lessons().values() if lesson.slow for test in lesson.tests}


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker else None


def pytest_itemcollected(item):
    if getattr(item, "nbmake", False):  # nbmake runs the course under test, in its folder
        item.filename = str(Path(os.environ[COURSE_ENV]) / item.path.name)
    if item.path.suffix == ".ipynb":
        group = "nbmake"
    elif item.path.name == "test_browser.py":
        group = _browser_chain(item)
    else:
        group = SERIAL_GROUPS.get(item.path.name)
    if group:
        item.add_marker(pytest.mark.xdist_group(group))
    if item.path.suffix == ".ipynb" or item.path.name in SLOW_FILES:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # xdist hands out groups in collection order: the notebook chains first, so that a worker starts on
    # each at once while the others take everything else.
    items.sort(key=lambda item: CHAINS_FIRST.index(_group(item)) if _group(item) in CHAINS_FIRST else len(CHAINS_FIRST))


def pytest_collection_finish(session):
    # On an xdist worker with --dist loadgroup, xdist appends "@group" to a grouped test's id; where it
    # does not (pytest 9.2 with xdist 3.8), the groups would silently run side by side.
    if getattr(session.config.option, "loadgroup", False):
        grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
        if grouped and "@" not in grouped[0].nodeid:
            raise pytest.UsageError("pytest-xdist ignores --dist loadgroup with this pytest (xdist issue 1386): "
                                    "install what pyproject.toml asks for (pip install -e '.[test]').")
