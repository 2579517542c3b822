"""Rank hooks: what an engine, or a client of the launcher such as the course, adds to each rank of a launch.
The bootstrap runs them by name and imports none itself.

A launch names its hooks in the rank's environment, HOOKS_ENV: module names, comma-separated, run in that
order. The engine names its own (`engines.rank_command(..., hooks=)`: the local engine's kill-after and
loopback store); a client names its own for every launch of its process with `use` (the course's records for
its checkers, `%load_ext ddp_helpers.course`). A hook module has
    start(folder: RunFolder, rank: int) -> None   before the script runs (patches, audit hooks, environment);
and may have
    finish(folder: RunFolder, rank: int) -> None  after the script ended, however it ended, before the rank's
                                                  exit is recorded (what it gathered, written to the run folder).
and may name, in WRAPPERS, its modules that wrap torch's functions (itself included where it does): their frames
are left out of the tracebacks a rank shows (`wrapper_files`).
A hook that fails to load or start stops the rank with its error: a launch that asked for it must not run
without it. Rank side: nothing here imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

#: the rank's hooks: module names, comma-separated, in order
HOOKS_ENV = "DDP_HELPERS_RANK_HOOKS"

_IN_USE: list[str] = []  # this process's launches' hooks, besides their engine's (`use`)
_LOADED: list[types.ModuleType] = []  # this rank's hooks (`load`)


def use(module: str) -> None:
    """Add the hook `module` to every launch this process makes from now on (once, however often asked)."""
    if module not in _IN_USE:
        _IN_USE.append(module)


def stop_using(module: str) -> None:
    if module in _IN_USE:
        _IN_USE.remove(module)


def in_use() -> tuple[str, ...]:
    return tuple(_IN_USE)


def load() -> list[types.ModuleType]:
    """The hooks this rank's launch named (HOOKS_ENV), imported, in order."""
    names = [name for name in os.environ.get(HOOKS_ENV, "").split(",") if name]
    _LOADED[:] = [importlib.import_module(name) for name in dict.fromkeys(names)]
    return list(_LOADED)


def wrapper_files() -> set[str]:
    """The files of the loaded hooks' wrappers around torch functions (each hook's WRAPPERS), as absolute paths."""
    names = [name for hook in _LOADED for name in getattr(hook, "WRAPPERS", ())]
    return {os.path.abspath(module.__file__) for name in names
            if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None)}


class PatchOnImport:
    """Patches applied to modules as the script imports them (a cold rank), or at once where they are imported
    already (the warm process imported torch): `PatchOnImport.install({"torch.serialization": patch})` calls
    `patch(module)` right after the module's own code ran."""

    def __init__(self, patches: dict):
        self.patches = dict(patches)

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.pop(fullname, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.patches:  # others still to come
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_then_patch(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec

    @classmethod
    def install(cls, patches: dict) -> None:
        pending = {}
        for name, patch in patches.items():
            module = sys.modules.get(name)
            if module is None:
                pending[name] = patch
            else:
                patch(module)
        if pending:
            sys.meta_path.insert(0, cls(pending))
