import textwrap
from pathlib import Path

import pytest

from ddp_helpers.config import Hardware

CPU_ONLY = Hardware(())


@pytest.fixture
def write_script(tmp_path):
    """write_script("name", source) -> path of a script file holding the dedented source."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture(autouse=True)
def runs_in_tmp(tmp_path, monkeypatch):
    # %%torchrun cells in tests write their scripts here, not into the project's runs/.
    monkeypatch.setenv("DDP_HELPERS_RUNS", str(tmp_path / "runs"))


@pytest.fixture(scope="session")
def ipython():
    """One IPython shell for the session (IPython's test shell is a singleton), with %%torchrun loaded."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "ddp_helpers")
    return shell


# pytest-xdist (-n 2 --dist loadgroup): tests in one group run one after another on one worker. Every
# notebook run (nbmake, the browser, launch_lesson.sh) keeps both cores busy for a minute or so, and
# the lessons time what they show: they run one at a time. The Slurm tests share one cluster.
SERIAL_GROUPS = {"test_browser.py": "notebooks", "test_launch_lesson.py": "notebooks", "test_slurm.py": "slurm"}


def pytest_itemcollected(item):
    # Marked as each item is collected: xdist reads the groups in its own pytest_collection_modifyitems.
    group = "notebooks" if item.path.suffix == ".ipynb" else SERIAL_GROUPS.get(item.path.name)
    if group:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    # On an xdist worker with --dist loadgroup, xdist appends "@group" to a grouped test's id; where it
    # does not (pytest 9.2 with xdist 3.8), the groups would silently run side by side.
    if getattr(session.config.option, "loadgroup", False):
        grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
        if grouped and "@" not in grouped[0].nodeid:
            raise pytest.UsageError("pytest-xdist ignores --dist loadgroup with this pytest (xdist issue 1386): "
                                    "install what pyproject.toml asks for (pip install -e '.[test]').")
