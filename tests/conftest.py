import textwrap
from pathlib import Path

import pytest

from ddp_helpers.default_job import Hardware
from ddp_helpers.course import keep_records

CPU_ONLY = Hardware(())
# The suite tests the course (its checkers judge the records its rank hook keeps) as a lesson's first cell,
# `%load_ext ddp_helpers.course`, sets it up; tests/test_rank_hooks.py turns it off for plain launches.
keep_records()


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


@pytest.fixture
def warm_launches():
    """The warm process up (started again if an earlier test stopped it) before the test launches: for tests whose timeouts must catch a run in the
    state it reaches within a second of starting, however loaded the machine is."""
    from ddp_helpers.default_job import prepare_warm_launches

    assert prepare_warm_launches(), "the warm process did not start"
