"""The library's structure, as issue 19 set it: one module spells the run folder's file names, the
package's modules import one another without a circle, and a rank's `record` loads no launcher code."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_helpers"
# The run folder's files, as run_folder.py names them.
RUN_FOLDER_NAMES = ("outcome.json", "torchrun.log", ".pid", ".stack", "error.json", "exit.json", "writes.json",
                    "p2p.json", "collectives.json", "hang.json", "hang.request", "flight_recorder", "pipes")


def modules() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): ast.parse(path.read_text())
            for path in PACKAGE.rglob("*.py")}


def strings_in_code(tree: ast.Module) -> list[str]:
    """String constants, docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_only_run_folder_spells_the_run_folders_file_names():
    spelled = {name: [s for s in strings_in_code(tree) if any(file in s for file in RUN_FOLDER_NAMES)]
               for name, tree in modules().items() if name != "run_folder"}
    assert {name: found for name, found in spelled.items() if found} == {}


def imports(name: str, tree: ast.Module) -> set[str]:
    """The package's modules `name` imports as it loads, leaving out `if TYPE_CHECKING:` blocks (annotations
    only) and imports inside functions."""
    package = name.rsplit(".", 1)[0] if "." in name else ""
    found = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".") if package else []
            base = parts[: len(parts) - (node.level - 1)]
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.update({stem} if node.module else {f"{stem}.{alias.name}".lstrip(".") for alias in node.names})
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child)

    walk(tree)
    return found


def test_the_packages_modules_import_one_another_without_a_circle():
    trees = modules()
    graph = {name: {imported for imported in imports(name, tree) if imported in trees and imported != name}
             for name, tree in trees.items()}
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


def test_record_in_a_rank_loads_no_launcher_code():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from ddp_helpers import record; "
                               "print(sorted(m for m in sys.modules if m.startswith('ddp_helpers')))"],
        capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["ddp_helpers", "ddp_helpers.recording", "ddp_helpers.run_folder"]


def imports_anywhere(name: str, tree: ast.Module) -> set[str]:
    """Every package module `name` imports, in functions too (TYPE_CHECKING blocks left out)."""
    package = name.rsplit(".", 1)[0] if "." in name else ""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".") if package else []
            base = parts[: len(parts) - (node.level - 1)]
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.update({stem} if node.module else {f"{stem}.{alias.name}".lstrip(".") for alias in node.names})
    return found


def test_engines_sit_behind_the_seam():
    """Only the magic (its --slurm options) knows the Slurm engine; the launcher knows the seam and the local
    engine; the kernel's side of warm launches does not load the zygote server; the supervisor's side loads
    nothing of the kernel's output streaming."""
    trees = modules()
    knows = {name: imports_anywhere(name, tree) for name, tree in trees.items()}
    assert sorted(name for name, found in knows.items() if "slurm" in found) == ["magic"]
    assert "slurm" not in knows["config"] and "local_engine" not in knows["config"]
    assert "zygote" not in knows["warm"]
    assert "output" not in knows["agents"] and "output" not in knows["supervisor"]


def test_no_function_is_longer_than_60_lines_without_a_reason():
    """A function body (docstring left out) over 60 lines says why in a comment starting "Long on purpose"."""
    long = []
    for name, tree in modules().items():
        source = (PACKAGE / (name.replace(".", "/") + ".py")).read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                if body and body[-1].end_lineno - body[0].lineno + 1 > 60:
                    text = "\n".join(source[node.lineno - 1:node.end_lineno])
                    if "# Long on purpose:" not in text:
                        long.append(f"{name}.{node.name}")
    assert long == []
