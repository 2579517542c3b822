"""Rank side: the bytes a rank's script moves through channels the flight recorder does not see.

torch's flight recorder (`_hang_probe.collectives_called`) records every collective a process group runs,
however the script reaches it: `torch.distributed`'s functions, the functional collectives, a comm hook,
`ProcessGroup` methods called directly. It does not record gloo's point-to-point sends, nor what goes
through the job's key-value store. The bootstrap therefore wraps, at the class, in every rank:
- `ProcessGroup.send` / `recv` / `recv_anysource` and the same methods of a process group's `Backend`:
  `dist.send`, `isend`, `batch_isend_irecv` and direct calls all pass through them;
- every data method of `Store` (`set`, `get`, `add`, `multi_set`, ...), whichever store the script holds
  (the default one, a `PrefixStore`, a `TCPStore` it opened itself).

A checker reads the totals (`RankResult.channel_bytes`) to count every byte of the run, not a window of
it. What stays uncounted, and is said so where a checker relies on the count: a tensor handed to torch's
C++ ops directly (`torch.ops.c10d.send`), and channels outside torch (a socket, a file, shared memory).
Files the ranks write are seen by the bootstrap's audit hook instead.
"""

from __future__ import annotations

import functools

totals = {"store_calls": 0, "store_bytes": 0, "sent_bytes": 0, "received_bytes": 0}

STORE_METHODS = ("set", "get", "add", "compare_set", "multi_set", "multi_get", "append", "queue_push", "queue_pop")
POINT_TO_POINT = {"send": "sent_bytes", "recv": "received_bytes", "recv_anysource": "received_bytes"}
INT_BYTES = 8  # `add` moves one int64 each way
_depth = 0  # ProcessGroup.send calls its Backend's: a call is counted once, where the script made it


def _size(value) -> int:
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, int):
        return INT_BYTES
    if isinstance(value, (list, tuple)):
        return sum(_size(item) for item in value)
    return 0


def _tensor_bytes(tensors) -> int:
    try:
        return sum(t.numel() * t.element_size() for t in tensors)
    except (TypeError, AttributeError):  # not a list of tensors: the call itself says what is wrong
        return 0


def _counting_store(method):
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        totals["store_calls"] += 1
        totals["store_bytes"] += _size(args) + _size(list(kwargs.values())) + _size(result)  # keys carry data too
        return result

    counted.__ddp_helpers_counted__ = True
    return counted


def _counting_point_to_point(method, total: str):
    @functools.wraps(method)
    def counted(self, tensors, *args, **kwargs):
        global _depth
        if not _depth:
            totals[total] += _tensor_bytes(tensors)
        _depth += 1
        try:
            return method(self, tensors, *args, **kwargs)
        finally:
            _depth -= 1

    counted.__ddp_helpers_counted__ = True
    return counted


def _wrap(cls, name: str, wrapper) -> None:
    method = cls.__dict__.get(name)
    if method is None or getattr(method, "__ddp_helpers_counted__", False):
        return
    setattr(cls, name, wrapper(getattr(cls, name)))


def observe(c10d_module=None) -> None:
    """Wrap torch's C++ classes (once per process: a warm rank may call it again). Called as
    `torch.distributed.distributed_c10d` is imported, whose extension module defines them."""
    import torch._C._distributed_c10d as classes

    for cls in (classes.ProcessGroup, classes.Backend):
        for name, total in POINT_TO_POINT.items():
            _wrap(cls, name, functools.partial(_counting_point_to_point, total=total))
    for name in STORE_METHODS:
        _wrap(classes.Store, name, _counting_store)


def summary() -> dict:
    return dict(totals)
