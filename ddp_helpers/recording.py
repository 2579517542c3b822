"""The script side of recording: a rank saves a value, the notebook reads it back.

In a script (a `%%torchrun` cell):

    from ddp_helpers import record
    record("indices", list(sampler))          # JSON-able values are stored as JSON
    record("grad", model.weight.grad)          # tensors (and structures holding them) via torch.save

In the notebook: `run.ranks[1].facts["indices"]`.

Outside the launcher (plain `python script.py` or `torchrun script.py`) `record` does nothing and
returns the value, so the same script runs anywhere.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

from .run_files import RUN_DIR_ENV, facts_dir, write_atomically

_VALID_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def record(name: str, value):
    """Save `value` under `name` for this rank, for the notebook to read back as `run.ranks[r].facts[name]`.

    Args:
        name (str): letters, digits, '_', '.', '-'; recording a name again replaces the value.
        value: a JSON-able value (numbers, strings, lists, dicts), a tensor, or a structure of
            tensors (saved with torch.save, read back with weights_only=True).

    Returns:
        The value, unchanged, so `x = record("x", compute())` reads naturally.
    """
    if not isinstance(name, str) or not _VALID_NAME.match(name):
        raise ValueError(f"record name must be letters, digits, '_', '.', '-' (e.g. 'grad_norm'), got {name!r}")
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return value
    folder = facts_dir(run_dir, int(os.environ.get("RANK", "0")))
    try:
        payload, suffix = json.dumps(value).encode(), ".json"
    except (TypeError, ValueError):
        payload, suffix = _torch_bytes(value), ".pt"
    stale = folder / f"{name}{'.pt' if suffix == '.json' else '.json'}"
    stale.unlink(missing_ok=True)
    write_atomically(folder / f"{name}{suffix}", payload)
    return value


def _torch_bytes(value) -> bytes:
    torch = sys.modules.get("torch")
    if torch is None:
        raise TypeError(f"record can store JSON-able values or tensors; got {type(value).__name__}")
    value = _to_cpu(value, torch)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _to_cpu(value, torch):
    # GPU tensors are moved so the notebook (often without a GPU context) can load them.
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v, torch) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v, torch) for v in value)
    return value


def read_facts(run_dir: str | os.PathLike, rank: int) -> dict:
    """Everything rank `rank` recorded in a run, by name."""
    facts = {}
    folder = facts_dir(run_dir, rank)
    if not folder.is_dir():
        return facts
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue  # a temporary file of an interrupted write
        if path.suffix == ".json":
            facts[path.stem] = json.loads(path.read_text())
        elif path.suffix == ".pt":
            import torch

            facts[path.stem] = torch.load(path, map_location="cpu", weights_only=True)
    return facts
