"""Rank side: what a rank's script hands to `all_reduce`, seen by the launcher.

The bootstrap wraps `torch.distributed.all_reduce` in every rank, so that a checker can see what each rank
put in, not only that an all-reduce of some shape happened (torch's flight recorder keeps shapes, never
values): lesson 5's checker asks that each rank contributed its own gradient every step, and a zero one
where it had no sample, which a rank all-reducing junk, or every rank computing every rank's gradient
itself, does not. Each of the first MAX_CALLS calls is logged with its shape, dtype and reduce op; a small
tensor's values too, as they were passed in. DDP's own gradient all-reduces run in C++ and are not seen
here (the flight recorder counts those), nor are calls inside code torch.compile traced."""

from __future__ import annotations

import functools
import sys

MAX_CALLS = 1000
# Elements: a small tensor's values are copied at each call; larger ones are logged by shape only, so that
# timed all-reduces (lesson 6's, 1 KiB and up) are not slowed by the copy.
MAX_VALUES = 64

calls: list[dict] = []
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


def _logged(function, is_compiling):
    @functools.wraps(function)
    def logged(tensor, *args, **kwargs):
        # Invisible to torch.compile: while Dynamo traces the script's code, `is_compiling()` is a constant True
        # (torch/compiler/__init__.py), so it traces torch's own all_reduce, as under plain torchrun, and the
        # logging (a .tolist() it cannot trace) never enters the graph. Compiled calls are not logged.
        if is_compiling():
            return function(tensor, *args, **kwargs)
        if len(calls) < MAX_CALLS:
            try:
                calls.append(_entry(tensor, args, kwargs))
            except Exception:  # noqa: BLE001 - not a tensor: all_reduce itself says what is wrong
                pass
        return function(tensor, *args, **kwargs)

    logged.__ddp_helpers_logged__ = True
    return logged


def observe(c10d_module) -> None:
    """Wrap `all_reduce` in `torch.distributed.distributed_c10d` (and in `torch.distributed`, which re-exports
    it, where a warm rank imported it already)."""
    function = getattr(c10d_module, "all_reduce", None)
    if function is None or getattr(function, "__ddp_helpers_logged__", False):
        return
    c10d_module.all_reduce = _logged(function, _compiler_check())
    package = sys.modules.get("torch.distributed")
    if package is not None:
        package.all_reduce = c10d_module.all_reduce


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


def summary() -> list[dict]:
    return list(calls)
