"""Counting the collectives a piece of code runs, for the lessons' communication evidence.

    from ddp_helpers.course.comm import count_collectives

    with count_collectives() as comm:
        loss.backward()
        optimizer.step()
    record("collectives", comm.summary())   # {"allreduce": {"calls": 1, "bytes": 4202536}, ...}

It is a `TorchDispatchMode`, like PyTorch's own `CommDebugMode` (which counts calls but not bytes): every
c10d collective called from Python or from C++ (DDP's reducer, FSDP, ZeroRedundancyOptimizer), and every
functional collective (`_c10d_functional`: DTensor's redistributions, tensor parallelism), passes through
the dispatcher, where it is seen here. "bytes" is the size of the whole tensor a collective works
on: the tensor all-reduced or broadcast, the full output of an all-gather, the full input of a
reduce-scatter. What one rank actually puts on the wire depends on the algorithm (a ring all-reduce
sends about twice that, an all-gather about (W - 1) / W of it).

Warning: a dispatch mode sees the thread that entered it (and autograd's threads, which inherit it). A
collective launched from another collective's callback, such as PowerSGD's second and third all-reduces
on gloo (callbacks run on gloo's own threads), is not counted: lesson 6 counts those by wrapping
`dist.all_reduce` instead.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op (as the dispatcher names it) -> the kind of collective it is.
_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv",
}
# Functional collectives (DTensor, tensor parallelism, torch.compile): `_c10d_functional::<op>`. Their
# all-gathers pass only this rank's shard and the group size.
_FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_": "broadcast", "all_to_all_single": "all_to_all",
}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class count_collectives(TorchDispatchMode):
    """Context manager: calls and bytes of every collective run inside it, by kind."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        # For each all-gather and reduce-scatter, in call order: how many ranks it spanned (the whole
        # tensor over this rank's shard), which a sub-group such as FSDP's reshard_after_forward=N makes
        # smaller than the world.
        self.group_sizes: dict[str, list[int]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kind = (_KINDS.get(name) if func.namespace == "c10d"
                else _FUNCTIONAL_KINDS.get(name) if func.namespace == "_c10d_functional" else None)
        if kind is not None:
            # Gathers and scatters pass the whole tensor and a shard (or a list of shards): take the whole.
            sizes = [sum(t.numel() * t.element_size() for t in _tensors(arg)) for arg in args]
            whole = max(sizes, default=0)
            if func.namespace == "_c10d_functional" and kind == "all_gather":
                whole *= args[1]  # (shard, group_size, group_name)
                self.group_sizes[kind].append(args[1])
            elif func.namespace == "_c10d_functional" and kind == "reduce_scatter":
                self.group_sizes[kind].append(args[2])  # (whole, reduce_op, group_size, group_name)
            elif kind in ("all_gather", "reduce_scatter"):  # c10d: the whole tensor and this rank's shard
                shard = min((size for size in sizes if size), default=0)
                self.group_sizes[kind].append(whole // shard if shard else 0)
            self.calls[kind] += 1
            self.bytes[kind] += whole
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"calls": n, "bytes": total}}, JSON-able (for `record`)."""
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


# Share of a collective's whole tensor that each rank receives with the usual ring algorithms, at world W.
_RING_SHARE = {
    "all_reduce": lambda w: 2 * (w - 1) / w,  # a reduce-scatter, then an all-gather
    "all_gather": lambda w: (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,  # on average over the ranks: the source receives nothing
}


def bytes_received_per_rank(summary: dict[str, dict[str, int]], world_size: int) -> dict[str, float]:
    """From `count_collectives().summary()`: {kind: bytes one rank receives}, assuming ring algorithms
    (what nccl uses for large tensors; gloo too, except for reduce-scatter, which torch runs on gloo as an
    all-reduce of the whole tensor: `ProcessGroupGloo.cpp`). Kinds without a ring estimate are left out."""
    return {kind: counts["bytes"] * _RING_SHARE[kind](world_size)
            for kind, counts in summary.items() if kind in _RING_SHARE}
