"""Which torch this is, whether the course was checked on it, and what differs between the versions it
runs on: decided here, once, not in the lessons.

The range is pyproject.toml's (a test keeps the two in step). The APIs the lessons name are older than its
floor (read in each version's wheel): `fully_shard`, `torch.distributed.pipelining`, DCP's `get_state_dict`
and `dcp_to_torch_save` (2.4), `torch.distributed.tensor.DTensor` (2.5), `MixedPrecisionPolicy` in
`torch.distributed.fsdp` and inductor's `default_cache_dir` (2.6), the flight recorder's generic dump
`torch._C._distributed_c10d._dump_fr_trace`, which gloo's groups record into (2.8's libtorch_python.so,
not 2.7's). The floor is where the course runs, run on PyPI's builds on CPU (2026-12-03):
- 2.8.0 and 2.9.1: three tests of the launcher fail (a failing rank's peers end "ok" rather than stopped by
  the agent, and a second user's attacks on the rendezvous stores never reach them), not examined further;
  on 2.9.1 lesson 1's pipeline schedules (`torch.distributed.pipelining` on gloo) abort a rank in native
  code (SIGABRT).
- 2.10.0: every notebook and the quick suite pass.

What differs inside the range:
- DDP's `forward_sync_buffers` (torch/nn/parallel/distributed.py) is 2.13's name for `broadcast_buffers`;
  2.13 still takes the old name, with a deprecation warning. `DDP_SYNC_BUFFERS` is the name this torch
  knows.
- torch 2.10's flight recorder keeps nothing unless TORCH_FR_BUFFER_SIZE is set (seen: an empty dump with
  gloo, entries with it set; 2.8's alike); 2.11's and 2.13's keep 2000 entries unless told otherwise (seen).
  Without entries there is no hang report (lessons 2 and 5) and the exercise checkers that count collectives
  see none: `rank_environment()` gives the ranks of an older torch the newer default, unless it is set.
- torch 2.10 prints gloo's "[Gloo] Rank N is connected to K peer ranks" on every rank's stdout
  (`GLOO_CONNECTION_LINE`); lesson 0 says so.

Nothing here imports torch: where torch is not imported yet, the installed version's metadata is read.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata

# pyproject.toml asks for torch>=LOWEST,<(the minor after NEWEST_CHECKED).
LOWEST = (2, 10)
NEWEST_CHECKED = (2, 14)
# The versions the whole course was run on, and how (docs/torch.md).
CHECKED = {
    "2.14.1": "2026-12-03: every notebook (nbmake) and the quick suite, PyPI's CUDA build run on CPU",
    "2.13.0": "2026-12-03: the whole suite, CPU build (the tested pin)",
    "2.12.1": "2026-12-03: every notebook (nbmake) and the quick suite, PyPI's CUDA build run on CPU",
    "2.11.0": "2026-12-03: every notebook (nbmake) and the quick suite, PyPI's CUDA build run on CPU",
    "2.10.0": "2026-12-03: every notebook (nbmake) and the quick suite, PyPI's CUDA build run on CPU",
}


@dataclass(frozen=True)
class Feature:
    """Something a lesson section needs from torch that older torch in (or below) the range lacks."""

    since: tuple[int, int]
    what: str
    sections: str


# What a torch below the floor was seen to lack (the docstring above), as lesson 0 says it.
FEATURES = (
    Feature((2, 10), "pipeline schedules that run on gloo", "lesson 1's pipeline section"),
)


def torch_version() -> str:
    """The installed torch's version: torch.__version__ where torch is imported already ('2.11.0+cu130' names
    the CUDA build), else the package's metadata, without importing torch (which may say '2.10.0')."""
    torch = sys.modules.get("torch")
    if getattr(torch, "__version__", None):
        return str(torch.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a torch built from source and put on sys.path: ask it
        import torch

        return torch.__version__


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.11.0+cu130' -> (2, 11); '2.14.0.dev20261101' -> (2, 14)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def in_checked_range(version: str | None = None) -> bool:
    return LOWEST <= release(version or torch_version()) <= NEWEST_CHECKED


def has(feature: Feature, version: str | None = None) -> bool:
    return release(version or torch_version()) >= feature.since


def _dotted(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


def report(version: str | None = None) -> str:
    """Lesson 0's lines on torch: the version, whether the course was checked on it, what it will skip."""
    version = version or torch_version()
    span = f"{_dotted(LOWEST)} to {_dotted(NEWEST_CHECKED)}"
    checked = ", ".join(sorted(CHECKED, key=lambda v: release(v)))
    if in_checked_range(version):
        lines = [f"PyTorch {version}: inside the course's range, {span} (run end to end on {checked})."]
    elif release(version) > NEWEST_CHECKED:
        lines = [f"PyTorch {version}: newer than the course's range, {span}. It will most likely work; if a "
                 "lesson fails, docs/torch.md says how to run the course on the tested one."]
    else:
        lines = [f"PyTorch {version}: older than the course's range, {span}, and never run with the course. "
                 f"Install torch {_dotted(LOWEST)} or newer (on a cluster, a newer module) if you can."]
    missing = [feature for feature in FEATURES if not has(feature, version)]
    lines += [f"Missing with this torch: {f.sections} (needs {f.what}, torch {_dotted(f.since)} or newer)."
              for f in missing]
    if not missing:
        lines.append("No section of the lessons is skipped with this torch.")
    if release(version) <= GLOO_PRINTS_ITS_CONNECTIONS_UP_TO:
        lines.append('Each rank will print "[Gloo] Rank N is connected to K peer ranks ..." as its gloo group '
                     "connects: this torch's own line (torch 2.11 dropped it), not an error.")
    return "\n".join(lines)


def _ddp_sync_buffers_name() -> str:
    return "forward_sync_buffers" if release(torch_version()) >= (2, 13) else "broadcast_buffers"


# DDP's keyword for broadcasting rank 0's buffers (BatchNorm's running statistics) at every forward.
DDP_SYNC_BUFFERS = _ddp_sync_buffers_name()


GLOO_PRINTS_ITS_CONNECTIONS_UP_TO = (2, 10)
# torch 2.10 and older print this from gloo's C++ on every rank's stdout, whatever TORCH_CPP_LOG_LEVEL says,
# as its gloo group connects (seen with 2.10.0; not with 2.11.0). The lessons leave it on the
# learner's screen, as plain torchrun shows it; lesson 0 says what it is.
GLOO_CONNECTION_LINE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected "
                                  r"peer ranks is : \d+\n?$")


def rank_environment() -> dict[str, str]:
    """What the launcher adds to the ranks' environment, where it is unset, so that every torch in the range
    records what the lessons read: the flight recorder on, at torch 2.11's default size."""
    return {} if release(torch_version()) >= (2, 11) else {"TORCH_FR_BUFFER_SIZE": "2000"}
