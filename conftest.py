"""Test-suite wiring for both test folders (tests/ and the notebooks nbmake collects): which tests run
one after another under pytest-xdist, and which the quick inner loop leaves out. Fixtures are in
tests/conftest.py."""

import pytest

# pytest-xdist (-n 2 --dist loadgroup): tests in one group run one after another on one worker. Every
# notebook run (nbmake, the browser, launch_lesson.sh) keeps both cores busy for a minute or so, and
# the lessons time what they show: they run one at a time. The Slurm tests share one cluster.
SERIAL_GROUPS = {"test_browser.py": "notebooks", "test_launch_lesson.py": "notebooks", "test_slurm.py": "slurm"}


# The quick inner loop, `scripts/run_tests.sh -m "not slow"`, leaves these out: whole notebooks, the
# browser, the Slurm cluster, and the launches that wait out timers, restarts or many runs.
SLOW_FILES = {"test_browser.py", "test_slurm.py", "test_exit_abort.py", "test_cleanup.py", "test_agents.py",
              "test_hostile.py", "test_lesson3.py", "test_lesson4.py"}


def pytest_itemcollected(item):
    # Marked as each item is collected: xdist reads the groups in its own pytest_collection_modifyitems.
    group = "notebooks" if item.path.suffix == ".ipynb" else SERIAL_GROUPS.get(item.path.name)
    if group:
        item.add_marker(pytest.mark.xdist_group(group))
    if item.path.suffix == ".ipynb" or item.path.name in SLOW_FILES:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # The notebook runs are the longest group: first in the queue, so that a worker starts on them at once
    # while the other takes everything else (xdist hands out groups in collection order).
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None
               or item.get_closest_marker("xdist_group").args[0] != "notebooks")


def pytest_collection_finish(session):
    # On an xdist worker with --dist loadgroup, xdist appends "@group" to a grouped test's id; where it
    # does not (pytest 9.2 with xdist 3.8), the groups would silently run side by side.
    if getattr(session.config.option, "loadgroup", False):
        grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
        if grouped and "@" not in grouped[0].nodeid:
            raise pytest.UsageError("pytest-xdist ignores --dist loadgroup with this pytest (xdist issue 1386): "
                                    "install what pyproject.toml asks for (pip install -e '.[test]').")
