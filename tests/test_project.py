"""Project hygiene that CI enforces: clean notebooks, matching dependency lists, README commands."""

import json
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from ddp_helpers.course.manifest import lessons
from support import course_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = course_notebooks()


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
    # nbformat 4.5 gives every cell an id (JupyterLab sends it with each run: a cell's default script name).
    ids = [cell.get("id") for cell in cells]
    assert all(ids) and len(set(ids)) == len(ids), f"{notebook.name}: every cell needs an id of its own"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_numbered(notebook):
    assert re.match(r"^\d\d[a-z]?_[a-z0-9_]+\.ipynb$", notebook.name)  # 02b_...: lesson 2's deep dive


def _requirement_names(requirements) -> set[str]:
    return {Requirement(r).name for r in requirements}


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["test"])


def _environment_yml_requirements() -> set[str]:
    conda_env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in conda_env["dependencies"] if isinstance(d, dict))
    return {r for r in pip_section if not r.startswith("-e")}


def _torch_requirement(requirements) -> Requirement:
    return next(Requirement(r) for r in requirements if Requirement(r).name == "torch")


def _tested_torch() -> str:
    return re.search(r'^tested_torch="([^"]+)"', (ROOT / "scripts" / "ensure_env.sh").read_text(), re.M).group(1)


def test_every_torch_range_the_readme_states_is_pyprojects():
    """'any torch from 2.10 to 2.14', 'torch>=2.10,<2.15': the README and docs/ say the range pyproject.toml asks for."""
    from ddp_helpers import torch_compat

    package_range = str(_torch_requirement(_pyproject_requirements()).specifier)
    readme = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    lowest, newest = (f"{v[0]}.{v[1]}" for v in (torch_compat.LOWEST, torch_compat.NEWEST_CHECKED))
    kept = re.findall(r"any torch from (\d+\.\d+) to (\d+\.\d+)", readme)
    asked = re.findall(r"`torch(>=[\d.]+,<[\d.]+)`", readme)
    assert kept and all(pair == (lowest, newest) for pair in kept), kept
    assert asked and all(set(a.split(",")) == set(package_range.split(",")) for a in asked), (asked, package_range)


def test_environment_yml_lists_the_same_packages_as_pyproject():
    pip_path, conda_path = _pyproject_requirements(), _environment_yml_requirements()
    assert _requirement_names(conda_path) == _requirement_names(pip_path)
    # torch aside (a range in the package, the tested pin in the course's environments), the same versions.
    assert {r for r in conda_path if not r.startswith("torch")} == {r for r in pip_path if not r.startswith("torch")}


def test_the_course_environments_pin_the_tested_torch_inside_the_packages_range():
    package_range = _torch_requirement(_pyproject_requirements()).specifier
    pin = _torch_requirement(_environment_yml_requirements())
    assert str(pin.specifier) == f"=={_tested_torch()}", "environment.yml and ensure_env.sh pin different torch"
    assert _tested_torch() in package_range, f"the tested torch {_tested_torch()} is outside pyproject's {package_range}"


def test_the_packages_torch_range_is_what_torch_compat_states():
    from ddp_helpers import torch_compat

    package_range = _torch_requirement(_pyproject_requirements()).specifier
    lowest, newest = torch_compat.LOWEST, torch_compat.NEWEST_CHECKED
    assert {str(s) for s in package_range} == {f">={lowest[0]}.{lowest[1]}", f"<{newest[0]}.{newest[1] + 1}"}
    # pip keeps a learner's torch anywhere in the range, a CUDA build's local label included.
    for version in ("2.10.0", "2.11.0+cu130", "2.13.0", "2.14.1+cu130"):
        assert Version(version) in package_range, version
    for version in ("2.9.1", "2.15.0"):
        assert Version(version) not in package_range, version
    assert all(Version(v) in package_range for v in torch_compat.CHECKED)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)
    assert commands[0].strip() == "scripts/launch_lesson.sh 0", "the README opens with the learner's command"
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


def test_the_tests_run_the_committed_course_not_a_learners_working_copy(tmp_path):
    # A project of one lesson, committed clean; then JupyterLab-like changes in the working tree: outputs
    # and an edit that fails, and an untracked copy. The suite must run the committed lesson, and leave
    # the working copies as they were.
    import nbformat
    import subprocess
    import sys

    project = tmp_path / "project"
    (project / "notebooks").mkdir(parents=True)
    (project / "tests").mkdir()
    for name in ("conftest.py", "pyproject.toml"):
        (project / name).write_text((ROOT / name).read_text())
    lesson = project / "notebooks" / "01_lesson.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("answer = 42")])
    nbformat.write(notebook, lesson)
    (project / "tests" / "test_probe.py").write_text(
        "import os, pathlib\n"
        "def test_probe():\n"
        "    course = pathlib.Path(os.environ['DDP_LESSONS_COURSE_UNDER_TEST'])\n"
        "    assert sorted(p.name for p in course.iterdir()) == ['01_lesson.ipynb']\n"
        "    assert 'answer = 42' in (course / '01_lesson.ipynb').read_text()\n"
        f"    assert not os.environ['DDP_HELPERS_RUNS'].startswith({str(project)!r})\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=project, check=True)
    subprocess.run(git + ["add", "-A"], cwd=project, check=True)
    subprocess.run(git + ["commit", "-qm", "course"], cwd=project, check=True)
    notebook.cells[0].source = "raise SystemExit('the learner is half-way through this cell')"
    notebook.cells[0].execution_count = 3
    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    nbformat.write(notebook, lesson)
    edited = lesson.read_bytes()
    (project / "notebooks" / "01_lesson-Copy1.ipynb").write_bytes(edited)

    env = {k: v for k, v in os.environ.items() if k not in ("DDP_LESSONS_COURSE_UNDER_TEST", "DDP_HELPERS_RUNS")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "--nbmake", "notebooks", "tests"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr
    assert "differ in your working tree: 01_lesson.ipynb, 01_lesson-Copy1.ipynb" in done.stdout
    assert lesson.read_bytes() == edited, "the learner's working copy was changed"


@pytest.mark.parametrize("asked", ["latest", "2.10", "torch==2.10.0", "2.10.0; rm -rf ~"])
def test_another_torch_for_the_scripts_is_a_version_number(asked):
    # DDP_LESSONS_TORCH=2.10.0 makes .venv-torch-2.10.0; anything else is refused before a venv is made.
    import subprocess

    done = subprocess.run(["bash", str(ROOT / "scripts" / "launch_lesson.sh"), "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DDP_LESSONS_TORCH": asked})
    assert done.returncode == 2, done.stderr
    assert f"DDP_LESSONS_TORCH is a torch version such as 2.10.0 (got '{asked}')." in done.stderr
    assert not list(ROOT.glob(".venv-torch-[!0-9]*")), "no venv may be made for a name that is no version"


@pytest.mark.parametrize("asked", ["cuda", "download.pytorch.org/whl/cpu", "https://x/cpu; rm -rf ~"])
def test_a_torch_index_for_the_scripts_is_an_address(asked):
    import subprocess

    done = subprocess.run(["bash", str(ROOT / "scripts" / "launch_lesson.sh"), "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DDP_LESSONS_TORCH_INDEX": asked})
    assert done.returncode == 2, done.stderr
    assert f"DDP_LESSONS_TORCH_INDEX is cpu, pypi, or the address of a package index, such as " \
           f"https://download.pytorch.org/whl/cpu (got '{asked}')." in done.stderr


def stand_in_project(tmp_path: Path, gpu: bool) -> tuple[Path, Path, dict[str, str]]:
    """A copy of the project's install script whose .venv python only writes down its pip calls (no download: PyTorch's
    index cannot be reached from here), and an `nvidia-smi` that lists a GPU or none. (project, calls, env)"""
    import shutil

    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "scripts/ensure_env.sh", "jupyter/overrides.json"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, project / name)
    calls = tmp_path / "pip-calls"
    python = project / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    python.chmod(0o700)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    (tools / "nvidia-smi").chmod(0o700)
    # The pin's environment, whichever torch this suite itself runs on (DDP_LESSONS_TORCH).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DDP_LESSONS_")},
           "PATH": f"{tools}:{os.environ['PATH']}"}
    return project, calls, env


def ensure_env(project: Path, env: dict[str, str]):
    import subprocess

    return subprocess.run(["bash", "-c", f"source {project}/scripts/ensure_env.sh"], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_torch_index_installs_torch_alone_from_it_then_the_course_from_pypi(tmp_path):
    """DDP_LESSONS_TORCH_INDEX: torch comes from that index, on its own, and the course's other packages from
    PyPI; the pip calls are read off a stand-in for the environment's python."""
    project, calls, env = stand_in_project(tmp_path, gpu=True)
    index = "https://download.pytorch.org/whl/cpu"
    done = ensure_env(project, {**env, "DDP_LESSONS_TORCH_INDEX": index})
    assert done.returncode == 0, done.stderr
    torch = f"torch=={_tested_torch()}"
    assert calls.read_text().splitlines() == [
        f"-m pip install --quiet --index-url {index} {torch}",
        f"-m pip install --quiet {torch} -e {project}",
    ]
    # Asked again, nothing is installed: the stamp names the index too.
    ensure_env(project, {**env, "DDP_LESSONS_TORCH_INDEX": index})
    assert len(calls.read_text().splitlines()) == 2


@pytest.fixture
def cpu_index():
    """An index that answers, on loopback, standing in for PyTorch's CPU index."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("case", ["no GPU, the CPU index answers", "no GPU, no CPU index", "a GPU"])
def test_the_first_install_picks_the_torch_build_that_fits_the_machine_and_says_why(tmp_path, case, cpu_index):
    project, calls, env = stand_in_project(tmp_path, gpu=case == "a GPU")
    env["DDP_LESSONS_CPU_TORCH_INDEX"] = cpu_index if case == "no GPU, the CPU index answers" else "http://127.0.0.1:9"
    done = ensure_env(project, env)
    assert done.returncode == 0, done.stderr
    torch = f"torch=={_tested_torch()}"
    course = f"-m pip install --quiet {torch} -e {project}"
    if case == "no GPU, the CPU index answers":
        assert calls.read_text().splitlines() == [f"-m pip install --quiet --index-url {cpu_index} {torch}", course]
        assert "No NVIDIA GPU here" in done.stderr and "CPU-only build" in done.stderr
        assert "DDP_LESSONS_TORCH_INDEX=pypi" in done.stderr  # how to choose the other
    else:  # where PyTorch's index cannot be reached (this machine, CI), nothing waits on it
        assert calls.read_text().splitlines() == [course]
        said = "An NVIDIA GPU is here" if case == "a GPU" else "did not answer"
        assert said in done.stderr and "DDP_LESSONS_TORCH_INDEX=cpu" in done.stderr, done.stderr


def test_the_test_tools_come_with_the_test_command_only(tmp_path):
    """The learner's environment holds what the course needs; pytest and Playwright come with run_tests.sh
    (DDP_LESSONS_EXTRAS=test), and a lesson launched after the tests installs nothing again."""
    project, calls, env = stand_in_project(tmp_path, gpu=True)
    ensure_env(project, env)
    ensure_env(project, {**env, "DDP_LESSONS_EXTRAS": "test"})
    ensure_env(project, env)
    torch = f"torch=={_tested_torch()}"
    assert calls.read_text().splitlines() == [f"-m pip install --quiet {torch} -e {project}",
                                              f"-m pip install --quiet {torch} -e {project}[test]"]
    assert "DDP_LESSONS_EXTRAS=test" in (ROOT / "scripts" / "run_tests.sh").read_text()


def _confirmed_text(node) -> str:
    """What a check() says it confirmed, its f-string values as "…"."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _confirmed_text(node.left) + _confirmed_text(node.right)
    return "…"


def lesson_checks(notebook: Path) -> list[tuple[str, str]]:
    """(cell id, the first 60 characters of what it confirms) of every ✓ (`check(...)`) in a notebook's cells."""
    import ast

    found = []
    for cell in json.loads(notebook.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.startswith("%%"):
            continue
        python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
        calls = [node for node in ast.walk(ast.parse(python)) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name) and node.func.id == "check"]
        for call in sorted(calls, key=lambda call: (call.lineno, call.col_offset)):
            found.append((cell["id"], " ".join(_confirmed_text(call.args[1]).split())[:60]))
    return found


LEDGER_LINE = re.compile(r'^- `([^`]+)` "(.*?)" — (.*)$', re.M)


def ledger_problems(course: dict, notebooks: list[Path]) -> list[str]:
    """What is wrong with the lessons' ledgers of ✓ checks (`checks.md` in each lesson's folder, its manifest's
    `ledger`): a ✓ in a notebook with no line there, a line no ✓ makes any more, a line that does not say what
    the ✓ fails for. `course`: the lessons by number (`manifest.lessons`)."""
    problems = []
    by_name = {notebook.name: notebook for notebook in notebooks}
    for lesson in course.values():
        if lesson.notebook not in by_name:
            continue
        listed = [m.groups() for m in LEDGER_LINE.finditer(lesson.ledger.read_text())] if lesson.ledger.is_file() else []
        in_notebook = lesson_checks(by_name[lesson.notebook])
        problems += [f'{lesson.ledger}: add - `{cell}` "{said}" — fails if …' for cell, said in in_notebook
                     if (cell, said) not in {(c, w) for c, w, _ in listed}]
        problems += [f"{lesson.ledger}: no ✓ in {lesson.notebook} says {said!r} (cell {cell}) any more"
                     for cell, said, _ in listed if (cell, said) not in in_notebook]
        problems += [f"{lesson.ledger}: say what the ✓ fails for: {said!r}" for _, said, why in listed
                     if not why.startswith("fails")]
    return problems


def test_every_check_in_the_lessons_names_a_script_it_fails_for():
    """Each lesson's ledger (its folder's checks.md) names, for each ✓, a change to the lesson's script for which it
    fails: a ✓ that no script can fail is a torch guarantee, and is printed with • (observed) instead."""
    assert sum(len(lesson_checks(notebook)) for notebook in NOTEBOOKS) > 50, "the notebooks hold few check(): is the reader broken?"
    assert ledger_problems(lessons(), NOTEBOOKS) == []


def test_every_notebook_of_the_course_is_a_lesson_with_a_manifest():
    """A notebook in notebooks/ that no lesson's manifest names is run by no browser test and has no ledger."""
    named = {lesson.notebook for lesson in lessons().values()}
    assert {notebook.name for notebook in NOTEBOOKS} - named == set()
    for lesson in lessons().values():
        assert callable(lesson.load_checker()) or (lesson.deep_dive and not lesson.checker), lesson.checker
        assert lesson.load_quiz(), f"lesson {lesson.key}'s quiz has no questions"
        assert lesson.readme_row in (ROOT / "README.md").read_text(), f"the README's row for lesson {lesson.key}:\n{lesson.readme_row}"
        assert all((ROOT / "tests" / test).is_file() for test in lesson.tests), lesson.tests


def kernel_names(source: str) -> tuple[set[str], set[str]]:
    """What a kernel cell does to the notebook's namespace: (names it binds at top level, names it reads from it
    without binding them itself), by Python's own symbol tables. A %%torchrun cell runs on the ranks: it binds
    only its --out variable in the kernel."""
    import symtable

    first_line = source.split("\n", 1)[0]
    if first_line.startswith("%%"):
        out = re.search(r"--out[ =](\w+)", first_line)
        return ({out.group(1) if out else "last_run"} if first_line.startswith("%%torchrun") else set()), set()
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    top = symtable.symtable(code, "<cell>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced() and s.get_name() not in bound}
    scopes = list(top.get_children())
    while scopes:
        scope = scopes.pop()
        read |= {s.get_name() for s in scope.get_symbols() if s.is_referenced() and s.is_global()} - bound
        scopes += scope.get_children()
    return bound, read


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_name_a_cell_reads_was_made_by_a_cell_above_it(notebook):
    """Run All in order leaves no cell reading a name no cell above it made: a lesson split into a core and a deep
    dive, or a cell moved, would otherwise fail only in the slow notebook runs (3b once read `warnings`, imported
    in a cell left in lesson 3)."""
    import builtins

    provided = set(dir(builtins)) | {"display", "get_ipython", "In", "Out", "exit", "quit"}  # IPython's own
    made, missing = set(), []
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        bound, read = kernel_names("".join(cell["source"]))
        missing += [f"cell {number} reads {name!r}" for name in sorted(read - made - provided)]
        made |= bound
    assert missing == [], f"{notebook.name}: no cell above makes these:\n" + "\n".join(missing)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_a_cell_run_again_after_run_all_reads_what_it_read_the_first_time(notebook):
    """A learner runs a cell again, after the whole notebook ran: what it reads from the kernel must still be what
    the cells above it made, not a later cell's value under the same name (lesson 2's explorer compared against
    lesson 2's no_sync counts, named `without` too, and blamed torch). Imports of the same thing are the same."""
    import ast

    cells = [(number, cell) for number, cell in enumerate(json.loads(notebook.read_text())["cells"])
             if cell["cell_type"] == "code"]
    numbers = [number for number, _ in cells]  # the cells' places in the notebook, as the messages say them
    sources = ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"] for _, cell in cells]
    named = [kernel_names(source) for source in sources]

    def binding(index: int, name: str) -> str:
        """How cell `index` binds `name`: its import statement, or "" (any other binding)."""
        if sources[index].startswith("%%"):
            return ""
        for node in ast.walk(ast.parse("\n".join(l for l in sources[index].splitlines()
                                                 if not l.lstrip().startswith(("%", "!"))))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    (alias.asname or alias.name).split(".")[0] == name for alias in node.names):
                return ast.dump(node)
        return ""

    rebound = []
    for index, (_, read) in enumerate(named):
        for name in sorted(read):
            before = [i for i in range(index) if name in named[i][0]]
            after = [i for i in range(index + 1, len(named)) if name in named[i][0]]
            if before and any(not binding(before[-1], name) or binding(i, name) != binding(before[-1], name)
                              for i in after):
                rebound.append(f"cell {numbers[index]} reads {name!r}, which cell {numbers[before[-1]]} made and cell "
                               f"{numbers[after[0]]} makes again")
    assert rebound == [], f"{notebook.name}: rename one of them:\n" + "\n".join(rebound)
