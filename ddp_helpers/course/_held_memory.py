"""What a rank's tensors hold in memory after each optimizer step: the evidence lesson 3's exercise is judged by
(a memory budget per rank). Every tensor Python can reach (`gc`) is counted, each storage once (a DTensor by its
local shard), and split into the parameters of the optimizers seen stepping, their gradients, the optimizers' state, and
the rest. Tensors only C++ holds (DDP's gradient buckets, an allocator's cache) are not seen: the count is a floor,
the same on every backend. Measured in the rank by a global optimizer hook (`register_optimizer_step_post_hook`),
so the script reports nothing about itself; written with the rank's other records as it ends (`records.write`).

Rank side: torch is imported only once a rank asks for the measurement (`watch`).
"""

from __future__ import annotations

import gc
import weakref

# One entry per optimizer step seen: {"parameters", "gradients", "optimizer_state", "other"}, in bytes.
steps: list[dict] = []
_watching = False
# Every optimizer seen stepping: one that wraps another (ZeRO-1's) holds its state in the inner one.
_optimizers: weakref.WeakSet = weakref.WeakSet()


def watch() -> None:
    """Measure after every optimizer step of this process from now on (once, however often it is asked)."""
    global _watching
    if not _watching:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_after_step)
        _watching = True


def summary() -> list[dict]:
    return list(steps)


def _storage(tensor):
    """(a key naming the tensor's storage, its bytes), or None for a tensor with no memory of its own."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor holds its shard
    tensor = local if local is not None else tensor
    try:
        if tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
    except Exception:  # noqa: BLE001 - a tensor subclass without storage (functional, fake): nothing held
        return None
    return ((str(storage.device), pointer), storage.nbytes()) if pointer else None


def _bytes(tensors, seen: set) -> int:
    total = 0
    for tensor in tensors:
        found = _storage(tensor)
        if found and found[0] not in seen:
            seen.add(found[0])
            total += found[1]
    return total


def _after_step(optimizer, args, kwargs) -> None:
    import torch

    try:
        _optimizers.add(optimizer)
        optimizers = list(_optimizers)
        parameters = [p for each in optimizers for group in each.param_groups for p in group["params"]]
        seen: set = set()
        steps.append({
            "parameters": _bytes(parameters, seen),
            "gradients": _bytes([p.grad for p in parameters if p.grad is not None], seen),
            "optimizer_state": _bytes([value for each in optimizers for state in each.state.values()
                                       for value in state.values() if isinstance(value, torch.Tensor)], seen),
            # type(), not isinstance(): isinstance reads __class__, which some objects answer with a warning.
            "other": _bytes([obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)], seen),
        })
    except Exception as error:  # noqa: BLE001 - evidence: never a reason for the rank to fail
        steps.append({"error": repr(error)[:200]})
