"""Rank side: the point-to-point messages a rank's script sends and receives, seen by the launcher.

The bootstrap wraps `torch.distributed`'s `send`, `recv`, `isend` and `irecv` in every rank, so that a
checker can see which tensors really crossed between ranks (lesson 1's pipeline exercise: the
activation went from stage 0 to stage 1, its gradient came back) instead of trusting what the script
records about itself. Each call is logged with its peer, shape and dtype; a small tensor's values are
kept too (a sent tensor's at the call, a received one's once `recv` returns; `irecv` completes later,
so only its shape is known). Collectives are not logged here (`ddp_helpers.course.comm` counts those).

A small sent tensor is also marked `grad_of_received` when it is the gradient of a tensor this rank
received (its `.grad`, or what `torch.autograd.grad` returned for it): the pipeline checker's evidence
that stage 1 computed from what it received, rather than recomputing stage 0 and sending for show.

And every backward (`torch.autograd.backward`, which `Tensor.backward` calls, and `torch.autograd.grad`) is logged
as {"op": "backward", "used_received": ..., "received_used": [...]}: whether a received tensor (or a copy of it)
was handed to it as the gradient of its outputs, or sits in the graph it runs, and which of the rank's receives
(numbered from 0 in the order called) those were: the pipeline checker's evidence that stage 0's gradients came from
the gradients stage 1 sent back, not from a loss stage 0 computed itself.

The calls one `dist.batch_isend_irecv` makes carry {"batch": n} (n counts the rank's batches): on nccl the calls of
one batch run together on the GPU, where any other point-to-point call runs on its own, after the ones before it
(lesson 1's checker judges a run's order as nccl would run it).
"""

from __future__ import annotations

import functools
import warnings
import weakref

MAX_CALLS = 1000  # a long pipeline run keeps its first calls only
MAX_VALUES = 4096  # elements: larger tensors are logged without their values
MAX_DIGESTED_BYTES = 1 << 20  # a byte tensor above MAX_VALUES and up to this size is logged with its digest

calls: list[dict] = []
# The blocking send or recv the script is in right now (None between calls), and how many point-to-point
# calls it has made: a timed-out run's hang report reads both (the flight recorder does not see gloo's).
waiting: dict | None = None
count = 0
_depth = 0
_batch: int | None = None  # the number of the batch_isend_irecv the script is in (None outside one)
_batches = 0
# The script's latest isend/irecv calls and their Work (weakly): one not completed is what a rank in
# `work.wait()` waits for, which neither `waiting` nor the flight recorder (gloo) shows.
_started: list[tuple[dict, weakref.ref]] = []
KEEP_STARTED = 16
_received: list[weakref.ref] = []  # the tensors the script received into (the last MAX_CALLS)
_gradients_of_received: list[weakref.ref] = []  # what torch.autograd.grad returned for a received tensor


def _entry(op: str, tensor, peer, with_values: bool) -> dict:
    entry = {"op": op, "peer": peer, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
    if with_values and tensor.numel() <= MAX_VALUES:
        entry["values"] = tensor.detach().cpu().double().flatten().tolist()
    elif with_values and str(tensor.dtype) == "torch.uint8" and tensor.numel() <= MAX_DIGESTED_BYTES:
        # Bytes too many to log (a random generator's state is 5,056): their digest, which a client can match
        # against what it finds elsewhere (a snapshot's states), as the course's collective log digests them.
        entry["digest"] = byte_digest(tensor)
    return entry


def byte_digest(tensor) -> str:
    """A byte tensor's digest (its bytes' sha256, shortened): the same in every log that digests one."""
    import hashlib

    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:32]


def _is_received(tensor) -> bool:
    return any(ref() is tensor for ref in _received)


def _same(tensor, other) -> bool:
    """`other` is `tensor`, or a copy of it (equal shape, dtype and values)."""
    import torch

    return other is tensor or (other is not None and other.shape == tensor.shape and other.dtype == tensor.dtype
                               and torch.equal(other.detach(), tensor.detach()))


def _gradient_of_received(tensor) -> bool:
    """Whether `tensor` (small: compared by value too, so a copy counts) is the gradient of a received tensor."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of a non-leaf tensor warns
        gradients = [ref().grad for ref in _received if ref() is not None and ref().grad is not None]
    gradients += [ref() for ref in _gradients_of_received if ref() is not None]
    return any(_same(tensor, g) for g in gradients)


def _peer(args, kwargs, name: str):
    value = kwargs.get(name, args[1] if len(args) > 1 else None)
    return value if value is not None else kwargs.get("group_" + name)


def _logged(op: str, function, values_after: bool):
    @functools.wraps(function)
    def logged(tensor, *args, **kwargs):
        global _depth, waiting, count
        if _depth:  # torch's send is built on its isend (recv on irecv): log the call the script made
            return function(tensor, *args, **kwargs)
        peer = _peer((tensor, *args), kwargs, "dst" if "send" in op else "src")
        # Its number (the script's point-to-point calls counted from 1), and its batch_isend_irecv if any.
        about = {"number": count + 1, **({} if _batch is None else {"batch": _batch})}
        if len(calls) < MAX_CALLS and not values_after:
            calls.append({**_entry(op, tensor, peer, with_values=op.endswith("send")), **about})
            if op.endswith("send") and tensor.numel() <= MAX_VALUES and (_received or _gradients_of_received):
                calls[-1]["grad_of_received"] = _gradient_of_received(tensor)
        if op.endswith("recv") and len(_received) < MAX_CALLS:
            _received.append(weakref.ref(tensor))
        _depth += 1
        count += 1
        if op in ("send", "recv"):
            waiting = {**_entry(op, tensor, peer, with_values=False), "number": count}
        try:
            result = function(tensor, *args, **kwargs)
        finally:
            _depth -= 1
            waiting = None
        if len(calls) < MAX_CALLS and values_after:
            calls.append({**_entry(op, tensor, peer if peer is not None else result, with_values=True), **about})
        if op in ("isend", "irecv") and result is not None:
            _started.append(({**_entry(op, tensor, peer, with_values=False), "number": count}, weakref.ref(result)))
            del _started[:-KEEP_STARTED]
        return result

    logged.__ddp_helpers_logged__ = True
    return logged


def unfinished() -> dict | None:
    """The latest isend/irecv whose Work has not completed (None if every one has, or was dropped)."""
    for entry, work in reversed(_started):
        alive = work()
        try:
            if alive is not None and not alive.is_completed():
                return entry
        except RuntimeError:  # a failed Work: not what a rank waits for
            continue
    return None


def _received_values(tensor) -> set[int]:
    """The receives (numbered from 0) whose tensor is `tensor`, or equal to it (a copy)."""
    return {number for number, ref in enumerate(_received) if _same(tensor, ref())}


def _used_received(roots, gradients) -> set[int]:
    """The receives whose tensor is among `gradients` (what a backward is handed for its `roots`), or is saved
    in the graph that backward runs (`(activation * received).sum().backward()`)."""
    import torch

    as_list = lambda value: list(value) if isinstance(value, (list, tuple)) else [value]
    used = set()
    for g in as_list(gradients):
        if torch.is_tensor(g):
            used |= _received_values(g)
    seen, frontier = set(), [r.grad_fn for r in as_list(roots) if torch.is_tensor(r) and r.grad_fn is not None]
    while frontier and len(seen) < 1000:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    saved = getattr(node, name)
                except RuntimeError:  # freed already (retain_graph=False on an earlier backward)
                    continue
                if torch.is_tensor(saved):
                    used |= _received_values(saved)
        frontier += [next_node for next_node, _ in node.next_functions]
    return used


def _note_backward(roots, gradients) -> None:
    global _depth
    if not _received or _depth or len(calls) >= MAX_CALLS:
        return
    _depth += 1
    try:
        used = sorted(_used_received(roots, gradients))
        calls.append({"op": "backward", "peer": None, "shape": [], "used_received": bool(used), "received_used": used})
    except Exception:  # noqa: BLE001 - evidence is best effort: the backward itself must run as the script wrote it
        pass
    finally:
        _depth -= 1


def _observing_backward(backward):
    @functools.wraps(backward)
    def observed(tensors, grad_tensors=None, *args, **kwargs):
        _note_backward(tensors, grad_tensors)
        return backward(tensors, grad_tensors, *args, **kwargs)

    observed.__ddp_helpers_logged__ = True
    return observed


def _observing_grad(grad):
    @functools.wraps(grad)
    def observed(outputs, inputs, *args, **kwargs):
        _note_backward(outputs, kwargs.get("grad_outputs", args[0] if args else None))
        results = grad(outputs, inputs, *args, **kwargs)
        if _received:
            for given, result in zip(inputs if isinstance(inputs, (list, tuple)) else [inputs], results):
                if result is not None and _is_received(given) and len(_gradients_of_received) < MAX_CALLS:
                    _gradients_of_received.append(weakref.ref(result))
        return results

    observed.__ddp_helpers_logged__ = True
    return observed


def _observing_batch(batch_isend_irecv):
    @functools.wraps(batch_isend_irecv)
    def observed(p2p_op_list, *args, **kwargs):
        global _batch, _batches
        if _batch is not None:
            return batch_isend_irecv(p2p_op_list, *args, **kwargs)
        _batch, _batches = _batches, _batches + 1
        try:
            return batch_isend_irecv(p2p_op_list, *args, **kwargs)
        finally:
            _batch = None

    observed.__ddp_helpers_logged__ = True
    return observed


def observe(c10d_module) -> None:
    """Wrap the point-to-point functions of `torch.distributed.distributed_c10d` (before `torch.distributed`
    re-exports them, or after, in a warm rank: then its names are rebound too)."""
    import sys

    wrapped = {}
    for op, values_after in (("send", False), ("recv", True), ("isend", False), ("irecv", False)):
        function = getattr(c10d_module, op, None)
        if function is None or getattr(function, "__ddp_helpers_logged__", False):
            continue
        wrapped[op] = _logged(op, function, values_after)
        setattr(c10d_module, op, wrapped[op])
    batch = getattr(c10d_module, "batch_isend_irecv", None)
    if batch is not None and not getattr(batch, "__ddp_helpers_logged__", False):
        wrapped["batch_isend_irecv"] = _observing_batch(batch)
        setattr(c10d_module, "batch_isend_irecv", wrapped["batch_isend_irecv"])
    package = sys.modules.get("torch.distributed")
    if package is not None:
        for op, function in wrapped.items():
            setattr(package, op, function)
    autograd = sys.modules.get("torch.autograd")
    if autograd is not None and not getattr(autograd.grad, "__ddp_helpers_logged__", False):
        autograd.grad = _observing_grad(autograd.grad)
    if autograd is not None and not getattr(autograd.backward, "__ddp_helpers_logged__", False):
        autograd.backward = _observing_backward(autograd.backward)


def summary() -> list[dict]:
    return list(calls)
