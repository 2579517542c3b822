"""The library's structure, as issue 19 set it: one module spells the run folder's file names, the
package's modules import one another without a circle, and a rank's `record` loads no launcher code."""

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_helpers"
# The run folder's files, as run_folder.py names them.
RUN_FOLDER_NAMES = ("outcome.json", "torchrun.log", "identity.json", ".stack", "error.json", "exit.json", "hang.json",
                    "hang.request", "supervisor.json", "kill_request", ".forked", "job-%j", "slurm-")
# The course's records of each rank in the run folder, as course/records.py names them.
COURSE_RECORD_NAMES = ("writes.json", "p2p.json", "collectives.json", "all_reduced.json", "channel_bytes.json", "held.json",
                       "activations.json")
# Folders of the run folder: common words, so a string spells one only when it is the name itself (torch's
# module torch.distributed.flight_recorder is not the folder).
RUN_FOLDER_DIRS = ("flight_recorder", "pipes", "facts")


@dataclass(frozen=True)
class Module:
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules() -> dict[str, Module]:
    """Every module of the package by its dotted name under ddp_helpers ("" for the package itself,
    "engines" for engines/__init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Module(path, ast.parse(path.read_text()))
    return found


def docstrings(tree: ast.Module) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def strings_in_code(tree: ast.Module) -> list[str]:
    """String constants, docstrings left out."""
    skip = docstrings(tree)
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]


def code_text(tree: ast.Module) -> str:
    """The module as code: its names and strings, comments and docstrings left out."""
    names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
    names += [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)]
    names += [node.name for node in ast.walk(tree) if isinstance(node, (ast.ClassDef, ast.FunctionDef))]
    names += [alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
              for alias in node.names] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return "\n".join(names + strings_in_code(tree))


# A run-folder file as prose names it: `rankN.hang.json`, `outcome.json`, `flight_recorder/rankN`, `job-%j.out`.
FILE_IN_PROSE = re.compile(r"\brank(N|K|0|1)\.(?!(writes|p2p|collectives|all_reduced|channel_bytes|held|activations)\.json|secret|crossings)[a-z]|\b(outcome|torchrun|supervisor|exit|error|identity|"
                           r"hang)\.(json|log|request)\b|agentK?\.outcome|kill_request\.json|"
                           r"(?<!distributed/)\b(flight_recorder|pipes|facts)/|\b(job|slurm)-(%j|<job id>)")
COURSE_RECORD_IN_PROSE = re.compile(r"\b(writes|p2p|collectives|all_reduced|channel_bytes|held|activations)\.json\b|rankN\.(secret|crossings)")


def spelled_outside(owner: str, names: tuple[str, ...], prose: re.Pattern, dirs: tuple[str, ...] = ()) -> dict:
    """{module: what it spells} of the modules besides `owner` that spell one of `names` in code, or `prose` in text."""
    found = {}
    for name, module in modules().items():
        if name == owner:
            continue
        in_code = [s for s in strings_in_code(module.tree) if any(file in s for file in names) or s.strip("/") in dirs]
        in_text = [line.strip() for line in module.path.read_text().splitlines() if prose.search(line)]
        if in_code or in_text:
            found[name] = in_code + in_text
    return found


def test_only_run_folder_spells_the_run_folders_file_names_in_code_and_docstrings():
    assert spelled_outside("run_folder", RUN_FOLDER_NAMES, FILE_IN_PROSE, RUN_FOLDER_DIRS) == {}


def test_only_the_courses_records_module_spells_its_records_names():
    assert spelled_outside("course.records", COURSE_RECORD_NAMES, COURSE_RECORD_IN_PROSE) == {}


def test_only_the_slurm_engine_knows_slurm():
    knowing = [name for name, module in modules().items()
               if "slurm" in code_text(module.tree).lower() and name not in ("engines.slurm", "slurm_commands")
               and not name.startswith("course.lessons")]
    assert knowing == []


def imports(name: str, module: Module, known: set[str], *, annotations: bool = False,
            in_functions: bool = False) -> set[str]:
    """The package's modules `name` imports: as it loads, or also in `if TYPE_CHECKING:` blocks (annotations)
    and in functions."""
    package = name.split(".") if module.is_package else name.split(".")[:-1]
    package = [part for part in package if part]
    found = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING" and not annotations:
            return
        if isinstance(node, ast.Import):  # `import ddp_helpers.course.checks`: absolute, as relative ones count
            found.update(alias.name.removeprefix("ddp_helpers").lstrip(".") for alias in node.names
                         if alias.name.split(".")[0] == "ddp_helpers")
        absolute = isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ddp_helpers"
        if isinstance(node, ast.ImportFrom) and (node.level or absolute):
            base = [] if absolute else package[: len(package) - (node.level - 1)]
            module = node.module.removeprefix("ddp_helpers").lstrip(".") if absolute else node.module
            stem = ".".join([*base, *(module.split(".") if module else [])])
            for alias in node.names:  # `from . import warm`: the module warm; `from .. import Ending`: the package
                candidate = f"{stem}.{alias.name}".lstrip(".")
                found.add(candidate if candidate in known else stem)
        for child in ast.iter_child_nodes(node):
            if in_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child)

    walk(module.tree)
    return found


def assert_no_circle(graph: dict[str, set[str]]) -> None:
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            assert state.get(imported) != "open", "import circle: " + " -> ".join([*path, name, imported])
            if imported not in state:
                visit(imported, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def import_graph(**how) -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    # A package's own __init__ runs before its modules: importing `engines.slurm` imports `engines` too, which
    # is no circle of its own making, so an edge to one's own package is left out.
    return {name: {imported for imported in imports(name, module, known, **how)
                   if imported in known and imported != name and not name.startswith(imported + ".")}
            for name, module in found.items()}


def test_the_packages_modules_import_one_another_without_a_circle():
    assert_no_circle(import_graph())


def test_no_circle_either_counting_the_imports_made_for_annotations_and_in_functions():
    assert_no_circle(import_graph(annotations=True))
    assert_no_circle(import_graph(annotations=True, in_functions=True))


def test_the_import_graph_sees_a_circle_when_there_is_one():
    assert_no_circle({"a": {"b"}, "b": set()})
    with pytest.raises(AssertionError, match="import circle: a -> b -> a"):
        assert_no_circle({"a": {"b"}, "b": {"a"}})


def test_record_in_a_rank_loads_no_launcher_code():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from ddp_helpers import record; "
                               "print(sorted(m for m in sys.modules if m.startswith('ddp_helpers')))"],
        capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["ddp_helpers", "ddp_helpers.recording", "ddp_helpers.run_folder"]


def test_engines_sit_behind_the_seam():
    """Nothing outside the engines imports an engine's module but the default job's place (`default_job`): the
    engines' base (`engines`) is the seam. No engine imports another; the kernel's side of warm launches does not
    load the zygote server; the supervisor's side loads nothing of the kernel's output streaming."""
    graph = import_graph(annotations=True, in_functions=True)
    outside = {name: {imported for imported in found if imported.startswith("engines.")}
               for name, found in graph.items() if not name.startswith("engines") and name != "default_job"}
    assert {name: found for name, found in outside.items() if found} == {}
    assert not any(imported.startswith("engines.local") for imported in graph["engines.slurm"])
    assert "engines.local.zygote" not in graph["engines.local.warm"]
    for name in ("engines.local.agents", "engines.local.supervisor"):
        assert "output" not in graph[name]


def test_the_import_graph_sees_absolute_imports_too():
    tree = ast.parse("import ddp_helpers.course.checks\nfrom ddp_helpers.engines import local\nfrom ddp_helpers import default_job\n")
    known = {"course.checks", "engines", "engines.local", "default_job", ""}
    assert imports("magic", Module(Path("magic.py"), tree), known) == {"course.checks", "engines.local", "default_job"}


def test_no_function_is_longer_than_60_lines_without_a_reason():
    """A function body (docstring left out) over 60 lines says why in a comment starting "Long on purpose"."""
    long = []
    for name, module in modules().items():
        source = module.path.read_text().splitlines()
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                if body and body[-1].end_lineno - body[0].lineno + 1 > 60:
                    text = "\n".join(source[node.lineno - 1:node.end_lineno])
                    if "# Long on purpose:" not in text:
                        long.append(f"{name}.{node.name}")
    assert long == []




def test_the_launcher_imports_no_course_module_and_the_bootstrap_no_hook():
    """The second seam (issue 51): launcher and engines know no course module, functions' imports included; the
    bootstrap imports no rank hook by name (`rank_hooks.load` reads them from the rank's environment)."""
    graph = import_graph(annotations=True, in_functions=True)
    course = {name for name in graph if name == "course" or name.startswith("course.")}
    launcher = {name: found & course for name, found in graph.items() if name not in course}
    assert {name: found for name, found in launcher.items() if found} == {}
    assert not graph["_bootstrap"] & (course | {"engines.local.rank_hook"})
    assert "rank_hook" not in "".join(strings_in_code(modules()["_bootstrap"].tree))
