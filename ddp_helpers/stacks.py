"""A timed-out rank's stack dump (faulthandler's text), folded to what the learner needs: the frames of
their own code, and the torch.distributed call each one waits in. The rest (the zygote, the bootstrap,
runpy, torch's logging wrappers, threads of ours) is counted, not shown; `run.ranks[r].stderr` keeps
the whole dump."""

from __future__ import annotations

import os
import re
import sysconfig

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<function>.+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
# The public collective API: the frame that says what a rank waits in (all_reduce, recv, barrier, ...).
_COLLECTIVES_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_FOLDERS = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def is_learner_frame(path: str) -> bool:
    """True for a file of the learner's: not Python's, not an installed package's, not ours."""
    if path.startswith("<") or path.startswith(_PACKAGE):
        return False
    return not (path.startswith(_LIBRARY_FOLDERS) or "/site-packages/" in path or "/dist-packages/" in path)


def fold_stack(dump: str) -> tuple[list[str], int]:
    """(the lines to show, the number of frames folded away) for one rank's faulthandler dump: per thread
    that runs learner code, its learner frames and the collective calls among them, innermost first."""
    threads: list[list[str]] = []
    for line in dump.splitlines():
        if _THREAD.match(line) or not threads:
            threads.append([])
        if _FRAME.match(line):
            threads[-1].append(line)
    shown, folded = [], 0
    for frames in threads:
        kept = []
        for line in frames:
            match = _FRAME.match(line)
            path = match["path"]
            if is_learner_frame(path):
                kept.append(f'  File "{os.path.basename(path)}", line {match["line"]} in {match["function"]}')
            elif path.endswith(_COLLECTIVES_FILE):
                kept.append(f"  waiting in torch.distributed.{match['function']}")
        if not any(line.startswith("  File") for line in kept):
            folded += len(frames)  # a thread of ours or torch's, without the learner's code
            continue
        folded += len(frames) - len(kept)
        shown.extend(kept)
    return shown, folded


def is_importing(dump: str) -> bool:
    """Whether the innermost learner frame of the thread running the learner's code is inside an import
    (importlib's frames above it): a rank still starting, `import torch` taking long on a loaded machine."""
    threads: list[list[str]] = []
    for line in (dump or "").splitlines():
        if _THREAD.match(line) or not threads:
            threads.append([])
        match = _FRAME.match(line)
        if match:
            threads[-1].append(match["path"])
    for paths in threads:  # innermost first
        learner = next((index for index, path in enumerate(paths) if is_learner_frame(path)), None)
        if learner is not None:
            return any(path.startswith("<frozen importlib") for path in paths[:learner])
    return False
