"""The activations autograd holds for backward in a rank, as they change: the evidence lesson 1's pipeline exercise
is judged by (how many micro-batches stage 0 holds at once, and whether the next forward had run when it asked for a
gradient). Measured in the rank, not reported by the script: `watch` pushes saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`) for the rest of the process, as lesson 1's schedule cell does inside a
`with`. A tensor autograd saves counts once per storage while any saved copy of it is held. Leaves are left out, and
views of leaves: the weights and the data, which a step holds whatever its schedule.

Each change is kept with the number of point-to-point calls the script had made by then (`_point_to_point.count`):
what the rank held can be read beside its point-to-point log (the calls' "number").

Rank side: torch is imported only once a rank asks for the measurement (`watch`).
"""

from __future__ import annotations

from .. import _point_to_point

MAX_CHANGES = 5000
# [point-to-point calls made so far, bytes held after the change]; written with the rank's other records.
changes: list[list[int]] = []
_hooks = None


class HeldForBackward:
    """Counts the bytes autograd holds for backward, through saved-tensor hooks (`pack`, `unpack`); `on_change`
    is called with the bytes held after each change."""

    def __init__(self, on_change=None):
        self.holders: dict[int, int] = {}
        self.now = self.peak = 0
        self.on_change = on_change

    def pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        if tensor.is_leaf or base.is_leaf:
            return tensor  # a weight, the data, or a view of one: held whatever the schedule
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.holders:
            self._add(storage.nbytes())
        self.holders[key] = self.holders.get(key, 0) + 1
        return _Held(tensor, self, key, storage.nbytes())

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self._add(-nbytes)

    def _add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        if self.on_change is not None:
            self.on_change(self.now)


class _Held:
    """What autograd keeps in place of a saved tensor; dropped once its backward has run (or its graph freed)."""

    def __init__(self, tensor, counter: HeldForBackward, key: int, nbytes: int):
        self.tensor, self.counter, self.key, self.nbytes = tensor, counter, key, nbytes

    def __del__(self):
        try:
            self.counter.release(self.key, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to count
            pass


def _note(now: int) -> None:
    if len(changes) < MAX_CHANGES:
        changes.append([_point_to_point.count, now])


def watch() -> None:
    """Count what autograd holds for backward in this process from now on (once, however often it is asked)."""
    global _hooks
    if _hooks is None:
        import torch

        counter = HeldForBackward(_note)
        _hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)
        _hooks.__enter__()  # never left: the rest of the script runs under it


def summary() -> list[list[int]]:
    return [list(change) for change in changes]


def peak(changes: list) -> int:
    return max((now for _, now in changes), default=0)


def saved_in_all(changes: list) -> int:
    """The bytes autograd was seen saving over the whole run (each increase of what it held, added up): one
    micro-batch's activations for each forward run with autograd and measured."""
    total, before = 0, 0
    for _, now in changes:
        total += max(0, now - before)
        before = now
    return total
