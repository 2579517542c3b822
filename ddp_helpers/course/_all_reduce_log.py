"""Rank side: what a rank's script hands to `all_reduce` and the other collectives that move its data, seen by
the launcher.

The bootstrap wraps `torch.distributed.all_reduce` in every rank, so that a checker can see what each rank
put in, not only that an all-reduce of some shape happened (torch's flight recorder keeps shapes, never
values): lesson 5's checker asks that each rank contributed its own gradient every step, and a zero one
where it had no sample, which a rank all-reducing junk, or every rank computing every rank's gradient
itself, does not. Each of the first MAX_CALLS calls is logged with its shape, dtype and reduce op; a small
tensor's values too, as they were passed in. DDP's own gradient all-reduces run in C++ and are not seen
here (the flight recorder counts those), nor are calls inside code torch.compile traced.

The other collectives that carry a rank's own data (all_gather, reduce, gather, broadcast, reduce_scatter and
their object forms: `OTHER_COLLECTIVES`) are logged the same way, apart, each entry naming its collective:
exercise checkers ask for positive evidence that each rank's own number went into a collective, by whichever
route. A collective torch calls inside another (all_gather_object's all_gathers) is not logged twice."""

from __future__ import annotations

import functools
import sys

from .._point_to_point import MAX_DIGESTED_BYTES, byte_digest

MAX_CALLS = 1000
# Elements: a small tensor's values are copied at each call; larger ones are logged by shape only, so that
# timed all-reduces (lesson 6's, 1 KiB and up) are not slowed by the copy.
MAX_VALUES = 64

calls: list[dict] = []
other_calls: list[dict] = []  # OTHER_COLLECTIVES', each with its "collective"
# The other collectives, and the argument that holds what this rank puts in: (position, keyword).
OTHER_COLLECTIVES = {"all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
                     "all_gather_single": (1, "input_tensor"), "reduce": (0, "tensor"), "broadcast": (0, "tensor"),
                     "gather": (0, "tensor"), "reduce_scatter_tensor": (1, "input"),
                     "reduce_scatter_single": (1, "input"), "all_gather_object": (1, "obj"),
                     "gather_object": (0, "obj"), "broadcast_object_list": (0, "object_list")}
_depth = 0  # > 0 inside a logged call: torch's own inner collectives are not the script's
# Set by a checker's rank-side code (lesson 7's exercise model): log every call's sum too, whatever its size,
# so the checker can tell that a rank all-reduced its own gradients, not zeros or other numbers for show.
# Off by default: a sum is a pass over the tensor, and lesson 6 times large all-reduces.
log_sums = False


def _entry(tensor, args, kwargs) -> dict:
    op = kwargs.get("op", args[0] if args else None)
    entry = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
             "op": "SUM" if op is None else str(op).rsplit(".", 1)[-1]}
    if tensor.numel() <= MAX_VALUES and not _capturing(tensor):
        entry["values"] = tensor.detach().cpu().double().flatten().tolist()
    elif log_sums and not _capturing(tensor):
        entry["sum"] = float(tensor.detach().double().sum())
    return entry


def _capturing(tensor) -> bool:
    """Whether a CUDA graph is being captured (copying to the CPU there would break the capture)."""
    if not tensor.is_cuda:  # every CPU rank's call: no import on this path
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def _logged(function, is_compiling, log=None, where=(0, None)):
    """`function` logging what it is handed: all_reduce's entry, or (`log`) another collective's input, the argument
    `where` names (position, keyword)."""
    @functools.wraps(function)
    def logged(*args, **kwargs):
        global _depth
        # Invisible to torch.compile: while Dynamo traces the script's code, `is_compiling()` is a constant True
        # (torch/compiler/__init__.py), so it traces torch's own all_reduce, as under plain torchrun, and the
        # logging (a .tolist() it cannot trace) never enters the graph. Compiled calls are not logged.
        if is_compiling() or _depth:
            return function(*args, **kwargs)
        target = calls if log is None else other_calls
        if len(target) < MAX_CALLS:
            try:
                target.append(_entry(args[0], args[1:], kwargs) if log is None else
                              {"collective": log, **_input_entry(_argument(args, kwargs, *where))})
            except Exception:  # noqa: BLE001 - not a tensor: the collective itself says what is wrong
                pass
        _depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            _depth -= 1

    logged.__ddp_helpers_logged__ = True
    return logged


def _argument(args, kwargs, position: int, keyword: str | None):
    return args[position] if len(args) > position else kwargs.get(keyword) if keyword else None


def byte_digests(value, depth: int = 0) -> list[str]:
    """A digest of every byte tensor in `value` (a tensor, or one inside dicts, lists and tuples): random states
    (torch.get_rng_state()) are byte tensors. The checker digests what a snapshot holds the same way."""
    if hasattr(value, "dtype") and hasattr(value, "numel"):
        if str(value.dtype) == "torch.uint8" and value.numel() <= MAX_DIGESTED_BYTES and not _capturing(value):
            return [byte_digest(value)]
        return []
    if depth >= 4:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [digest for item in list(items)[:64] for digest in byte_digests(item, depth + 1)]


def _input_entry(value) -> dict:
    """What a rank put into a collective: a small tensor's values, a number, or a short list of numbers; and the
    digests of the byte tensors in it (`byte_digests`)."""
    digests = byte_digests(value)
    entry = _input_values(value)
    return {**entry, "digests": digests} if digests else entry


def _input_values(value) -> dict:
    if hasattr(value, "shape") and hasattr(value, "detach"):
        entry = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
        if value.numel() <= MAX_VALUES and not _capturing(value):
            entry["values"] = value.detach().cpu().double().flatten().tolist()
        elif log_sums and not _capturing(value) and value.is_floating_point():
            entry["sum_of_squares"] = float(value.detach().double().square().sum())
        return entry
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"values": [float(value)]}
    if isinstance(value, (list, tuple)) and len(value) <= MAX_VALUES:
        numbers = [float(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tensors = [v for v in value if hasattr(v, "numel") and v.numel() <= MAX_VALUES and not _capturing(v)]
        numbers += [x for v in tensors for x in v.detach().cpu().double().flatten().tolist()]
        return {"values": numbers} if numbers else {}
    return {}


def observe(c10d_module) -> None:
    """Wrap `all_reduce` and `OTHER_COLLECTIVES` in `torch.distributed.distributed_c10d` (and in `torch.distributed`,
    which re-exports them, where a warm rank imported it already)."""
    function = getattr(c10d_module, "all_reduce", None)
    if function is None or getattr(function, "__ddp_helpers_logged__", False):
        return
    is_compiling = _compiler_check()
    c10d_module.all_reduce = _logged(function, is_compiling)
    for name, where in OTHER_COLLECTIVES.items():
        if hasattr(c10d_module, name) and not getattr(getattr(c10d_module, name), "__ddp_helpers_logged__", False):
            setattr(c10d_module, name, _logged(getattr(c10d_module, name), is_compiling, name, where))
    package = sys.modules.get("torch.distributed")
    if package is not None:
        for name in ("all_reduce", *OTHER_COLLECTIVES):
            if hasattr(c10d_module, name):
                setattr(package, name, getattr(c10d_module, name))


def _compiler_check():
    """torch.compiler.is_compiling, once torch has finished loading (c10d may load while `import torch` runs)."""
    found = None

    def is_compiling() -> bool:
        nonlocal found
        if found is None:
            compiler = getattr(sys.modules.get("torch"), "compiler", None)
            if compiler is None:
                return False
            found = compiler.is_compiling
        return found()

    return is_compiling


def log_ddp_gradients() -> None:
    """From now on, in this rank: what each DDP model's backward hands DDP's reducer, each parameter's local
    gradient, logged as {"collective": "ddp", "parameter": i, "sum", "values" (small ones)}. DDP all-reduces its
    buckets from C++, where nothing here sees them, and those local gradients are what it copies into them. Called by an exercise's
    rank-side helper (lesson 5's `my_shard`): DDP models made before or after the call are seen, at their first
    forward. Only a backward that DDP all-reduces is logged (its forward ran outside `no_sync`), with what DDP then
    hands on: the gradient accumulated over the micro-batches before it, this one's added. Logging only: the
    gradients are not changed."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.forward
    if getattr(original, "__ddp_helpers_logged__", False):
        return

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not getattr(self, "_ddp_helpers_logged", False):
            self._ddp_helpers_logged = True
            for index, parameter in enumerate(p for p in self.module.parameters() if p.requires_grad):
                parameter.register_hook(functools.partial(_log_ddp_gradient, self, index, parameter))
        # DDP decides in the forward whether this backward all-reduces (`no_sync` sets the flag False); the flag is
        # cleared as the backward ends, so a backward with no DDP forward before it (through `ddp.module`) is not logged.
        import torch

        self._ddp_helpers_syncs = self.require_backward_grad_sync and torch.is_grad_enabled()
        return original(self, *args, **kwargs)

    forward.__ddp_helpers_logged__ = True
    DistributedDataParallel.forward = forward


def _log_ddp_gradient(ddp, index: int, parameter, gradient) -> None:
    if not getattr(ddp, "_ddp_helpers_syncs", False):
        return  # a micro-batch under no_sync, or a backward DDP's forward did not prepare: DDP sends nothing of it
    if not getattr(ddp, "_ddp_helpers_clearing", False):  # the backward's first logged gradient: clear at its end
        import torch

        ddp._ddp_helpers_clearing = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_ended, ddp))
    if parameter.grad is not None:  # the micro-batches before, accumulated: DDP sends their sum with this one
        gradient = parameter.grad + gradient
    if len(other_calls) < MAX_CALLS and not _capturing(gradient):
        entry = {"collective": "ddp", "parameter": index, "shape": list(gradient.shape),
                 "sum": float(gradient.detach().double().sum())}
        if gradient.numel() <= MAX_VALUES:
            entry["values"] = gradient.detach().cpu().double().flatten().tolist()
        other_calls.append(entry)


def _backward_ended(ddp) -> None:
    ddp._ddp_helpers_syncs = ddp._ddp_helpers_clearing = False


def summary() -> list[dict]:
    """The all_reduce calls (no "collective" key), then the other collectives' (each with its "collective")."""
    return list(calls) + list(other_calls)
