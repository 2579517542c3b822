"""Project hygiene that CI enforces: clean notebooks, matching dependency lists, README commands."""

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ should hold the course"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    for index, cell in enumerate(cells):
        assert not cell.get("outputs"), f"{notebook.name} cell {index} has outputs: clear them before committing"
        assert cell.get("execution_count") is None, f"{notebook.name} cell {index} has an execution count"
        extra = set(cell.get("metadata", {})) - {"tags"}
        assert not extra, f"{notebook.name} cell {index} carries editor metadata {extra}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_numbered(notebook):
    assert re.match(r"^\d\d_[a-z0-9_]+\.ipynb$", notebook.name)


def _requirement_names(requirements) -> set[str]:
    return {re.split(r"[\s;]", r, maxsplit=1)[0] for r in requirements}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_path = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    conda_env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in conda_env["dependencies"] if isinstance(d, dict))
    conda_path = {r for r in pip_section if not r.startswith("-e")}
    assert _requirement_names(conda_path) == _requirement_names(pip_path)
    assert conda_path == pip_path, "versions differ between environment.yml and pyproject.toml"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)
    assert commands[0].strip() == "scripts/launch_lesson.sh 2", "the README opens with the learner's command"
    test_command = next(c.strip() for c in commands if "run_tests.sh" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_a_solution_that_repeats_the_whole_cell_shows_its_changes_first(notebook):
    cells = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "markdown"]
    for cell in (c for c in cells if "Show the solution" in c):
        whole = re.search(r"```python\n%%torchrun", cell)
        if whole:
            assert "```diff" in cell[:whole.start()], f"{notebook.name}: show the lines that change before the whole cell"
