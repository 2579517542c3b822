"""The script side of recording: a rank saves a value, the notebook reads it back.

In a script (a `%%torchrun` cell):

    from ddp_helpers import record
    record("indices", list(sampler))          # JSON-able values are stored as JSON
    record("loss", np.float32(0.25))           # numpy scalars become numbers, arrays lists
    record("grad", model.weight.grad)          # tensors (and structures holding them) via torch.save

In the notebook: `run.ranks[1].facts["indices"]`.

A value that cannot be stored fails here, in the rank, at the `record` call, naming the fact and
what to pass instead: never later, when the notebook reads it back.

Outside the launcher (plain `python script.py` or `torchrun script.py`) `record` does nothing and
returns the value, so the same script runs anywhere.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

from .run_folder import SECRET_ENV, RunFolder, write_atomically

_VALID_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")  # it names a file: at most 200 characters
_WHAT_TO_PASS = (
    "numbers, strings, booleans, None, lists, tuples and dicts with string keys of those, numpy scalars and "
    "arrays, or torch tensors (and lists/dicts of tensors)"
)


class RecordError(TypeError):
    """A value `record` cannot store; raised in the rank at the `record` call."""


def record(name: str, value):
    """Save `value` under `name` for this rank, for the notebook to read back as `run.ranks[r].facts[name]`.

    Args:
        name (str): 1 to 200 letters, digits, '_', '.', '-'; recording a name again replaces the value.
        value: a JSON-able value (numbers, strings, lists, dicts with string keys), numpy scalars and
            arrays (read back as numbers and lists), a tensor, or a structure of tensors (saved with
            torch.save, read back with weights_only=True, on the CPU).

    Returns:
        The value, unchanged, so `x = record("x", compute())` reads naturally.

    Raises:
        RecordError: the value cannot be stored; the message names the fact, the type, and what to pass.
    """
    if not isinstance(name, str) or not _VALID_NAME.match(name):
        raise ValueError("record name must be 1 to 200 letters, digits, '_', '.', '-' (e.g. 'grad_norm'), got "
                         f"{name if not isinstance(name, str) or len(name) <= 80 else name[:80] + '...'!r}")
    folder = RunFolder.from_environment()
    if folder is None:
        return value
    payload, suffix = _encode(name, value)
    if not folder.belongs_to_this_launch():
        # An orphan of an earlier launch must not write into a later launch's results.
        raise RuntimeError(f"record({name!r}): the run folder {folder.path} now belongs to another launch")
    facts = folder.facts_dir(int(os.environ.get("RANK", "0")))
    stale = facts / f"{name}{'.pt' if suffix == '.json' else '.json'}"
    stale.unlink(missing_ok=True)
    write_atomically(facts / f"{name}{suffix}", payload)
    return value


def _encode(name: str, value) -> tuple[bytes, str]:
    """(bytes, suffix) for `value`: JSON when it has no tensor in it, else torch.save bytes that are
    checked to load back with weights_only=True."""
    try:
        plain = _plain(value)
    except _HasTensor:
        return _torch_bytes(name, value), ".pt"
    except _Unstorable as bad:
        if "torch" in sys.modules:  # torch.save also takes what JSON cannot: int keys (optimizer state)
            return _torch_bytes(name, value), ".pt"
        raise RecordError(_unstorable_message(name, value, bad.value)) from None
    try:
        return json.dumps(plain, allow_nan=True).encode(), ".json"
    except (TypeError, ValueError) as error:
        raise RecordError(f"record({name!r}, ...): {error}. Pass {_WHAT_TO_PASS}.") from None


class _HasTensor(Exception):
    pass


class _Unstorable(Exception):
    def __init__(self, value):
        self.value = value


def _plain(value, depth: int = 0):
    """The JSON form of `value`; raises _HasTensor if a tensor is inside, _Unstorable for anything else."""
    if depth > 100:
        raise _Unstorable(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.generic):
            if isinstance(value, (numpy.number, numpy.bool_)):
                return value.item()
            raise _Unstorable(value)
        if isinstance(value, numpy.ndarray):
            if value.dtype.kind not in "biuf":  # bool, int, unsigned, float
                raise _Unstorable(value)
            return value.tolist()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise _HasTensor
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Unstorable(value)
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    raise _Unstorable(value)


def _unstorable_message(name: str, value, part) -> str:
    where = "" if part is value else f" (it holds a {type(part).__module__}.{type(part).__qualname__})"
    hint = ""
    if isinstance(value, dict) or isinstance(part, dict):
        hint = " Dict keys must be strings."
    return (
        f"record({name!r}, ...) cannot store a value of type {type(value).__module__}.{type(value).__qualname__}"
        f"{where}.{hint} Pass {_WHAT_TO_PASS}; for other objects record what you need of them "
        f"(e.g. str(x), a number, or a tensor)."
    )


def _torch_bytes(name: str, value) -> bytes:
    torch = sys.modules["torch"]
    try:
        value = _for_torch_save(value, torch)
    except _Unstorable as bad:
        raise RecordError(_unstorable_message(name, value, bad.value)) from None
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    try:  # the notebook loads with weights_only=True: make sure that works now, in the rank
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any refusal means the notebook could not read it
        raise RecordError(
            f"record({name!r}, ...): this value would not load back safely ({type(error).__name__}). "
            f"Pass {_WHAT_TO_PASS}."
        ) from None
    return data


def _for_torch_save(value, torch):
    """Tensors moved to the CPU (the notebook often has no GPU context); numpy made torch-native."""
    if isinstance(value, torch.Tensor):
        plain = value.detach().cpu()
        if type(plain) is not torch.Tensor:
            # A wrapper subclass such as the AsyncCollectiveTensor a tensor-parallel layer returns: an op
            # through its dispatch gives the plain tensor it stands for.
            plain = plain.clone()
        return plain
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) for k in value):
            raise _Unstorable(value)
        return {k: _for_torch_save(v, torch) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_for_torch_save(v, torch) for v in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
        if value.dtype.kind not in "biuf":
            raise _Unstorable(value)
        return torch.from_numpy(numpy.array(value)) if isinstance(value, numpy.ndarray) else value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _Unstorable(value)


_OWN_SECRET: list[int] = []


def rank_secret() -> int:
    """A number only this rank's process is handed, drawn at random for each launch (the same after a
    restart): an exercise's data comes from it, so that no rank can compute another's without asking it, and
    its checker reads every rank's from the run folder. Outside the launcher, a number drawn once per process."""
    if os.environ.get(SECRET_ENV, "").isdigit():
        return int(os.environ[SECRET_ENV])
    if not _OWN_SECRET:
        import secrets

        _OWN_SECRET.append(secrets.randbits(62))
    return _OWN_SECRET[0]
