"""scripts/gpu_check.sh, the check of the course's nccl path prepared for the day a GPU machine is lent: here,
its CPU fallback (it says there is no GPU and what it would run), its wheel bundle (small, and enough to
install offline), and its checks' own logic run on gloo, so that a check that cannot fail, or that fails for
a reason of its own, is found before anyone spends GPU time on it."""

import json
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_what_it_would_run():
    # CUDA_VISIBLE_DEVICES="": no GPU, as on a laptop, on a GPU machine too.
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "No NVIDIA GPU found here" in done.stdout and "nothing was checked" in done.stdout
    for check, _ in gpu_check().PLAN:
        assert f"  - {check}: " in done.stdout, done.stdout
    assert not (ROOT / ".venv-gpu-check").exists() or "venv" not in done.stderr  # it installs nothing here


def test_it_refuses_unknown_arguments_and_a_python_without_torch(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Usage: scripts/gpu_check.sh [--bundle]" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": "/usr/bin/true"})
    assert done.returncode == 2 and "No torch in '/usr/bin/true'" in done.stderr


@pytest.mark.slow
def test_the_wheel_bundle_is_small_and_installs_offline(tmp_path):
    # The bundle comes from PyPI (pip download); the install then uses it alone (--no-index).
    done = subprocess.run(["bash", str(SCRIPT), "--bundle"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = ROOT / "gpu_check_wheels"
    size_mib = sum(p.stat().st_size for p in wheels.iterdir()) / 2**20
    assert size_mib < 40, f"the bundle is {size_mib:.0f} MiB"
    names = {zipfile.Path(p).name.split("-")[0].lower() for p in wheels.glob("*.whl")}
    assert not names & {"torch", "numpy", "matplotlib", "jupyterlab"}, names
    for python_version in ("3.11", "3.12"):  # this machine's, and the GPU machine's
        target = tmp_path / python_version
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheels),
             "--only-binary=:all:", "--python-version", python_version, "--target", str(target),
             "ipython", "ipywidgets", "nbformat", "tqdm", "py-spy"],
            capture_output=True, text=True, timeout=300)
        assert install.returncode == 0, install.stdout + install.stderr
        assert "Would install" in install.stdout


@pytest.fixture
def check(tmp_path):
    module = gpu_check()
    module.results.clear()
    return module


def test_the_launch_check_holds_on_a_correct_run_warm_and_cold(check, tmp_path):
    check.check_all_reduce(tmp_path, world=2, cold=False, backend="gloo")
    check.check_all_reduce(tmp_path, world=2, cold=True, backend="gloo")
    assert [(name, held) for name, held, _ in check.results] == [("warm launch", True), ("cold launch", True)], \
        check.results
    assert "forked from the warm process: True" in check.results[0][2]


def test_the_exercise_check_tells_the_solution_from_the_cell_as_given(check, tmp_path):
    check.check_exercise(tmp_path, gpus=2, backend="gloo")
    assert check.results == [("exercise checker", True,
                              "the solution judged right, the cell as given judged wrong")], check.results


@pytest.mark.slow
def test_the_hang_check_finds_the_rank_that_never_called(check, tmp_path):
    check.check_hang_report(tmp_path, gpus=2, backend="gloo", timeout_s=12)  # a warm start on CPU
    [(name, held, detail)] = check.results
    assert held, detail


@pytest.mark.slow
def test_one_gpus_cells_run_at_world_one(check, ipython):
    # Lesson 0's %%torchrun cells, each at world 1 (the backend here: gloo). Lesson 1's model-parallel cells
    # need 2 ranks: on gloo they are failures, which on a GPU would be told apart by running them on gloo.
    # In the session's IPython shell: IPython allows one kind of shell per process (test_magic's, here).
    notebook = ROOT / "notebooks" / "00_check_setup.ipynb"
    ran, failures, need_two = check.run_cells_at_world_one(notebook, backend="gloo", shell=ipython)
    cells = [c for c in json.loads(notebook.read_text())["cells"] if "".join(c["source"]).startswith("%%torchrun")]
    assert ran == len(cells) >= 3 and failures == [] and need_two == [], failures  # hello, collectives, exercise


@pytest.mark.slow
def test_a_cell_that_needs_two_ranks_is_a_failure_at_world_one(check, ipython):
    ran, failures, _ = check.run_cells_at_world_one(ROOT / "notebooks" / "01_data_vs_model_parallelism.ipynb",
                                                   backend="gloo", shell=ipython)
    assert any("run it on 2 ranks" in failure for failure in failures), failures
