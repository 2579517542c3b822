"""Lesson 6: a `torch.profiler` trace read as data. `prof.export_chrome_trace(path)` writes the Chrome trace
format (what Perfetto and chrome://tracing open): a list of events, each with a name, a thread and a start
and duration in microseconds. `profiled_step` keeps one profiled step's phases on the thread that ran the
training loop and the collectives, which gloo runs on threads of its own and nccl as kernels on a GPU
stream.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# How the profiler names a collective: "gloo:all_reduce", "nccl:all_reduce" (the process group's record of
# each call), and nccl's kernels ("ncclDevKernel_AllReduce_Sum_f32_RING_LL").
COLLECTIVE = re.compile(r"^(gloo|nccl):|^nccl", re.IGNORECASE)
ALL_REDUCE = re.compile(r"all_?reduce", re.IGNORECASE)
# The main thread's phases, by the start of an event's name.
PHASES = (("DistributedDataParallel.forward", "forward"), ("autograd::engine::evaluate_function: ", "backward"),
          ("Optimizer.step", "optimizer step"))


@dataclass(frozen=True)
class Span:
    """One event of the step: `kind` is "forward", "backward", "optimizer step" or the collective's name;
    `thread` is "training loop" or "communication k"; times in milliseconds from the step's start."""

    kind: str
    thread: str
    start_ms: float
    duration_ms: float

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


def profiled_step(path: str | Path, step: str | None = None) -> tuple[list[Span], float]:
    """(the spans of one profiled step, the step's length in ms): the step named `step` ("ProfilerStep#3"),
    by default the last one the trace holds.

    On a GPU, autograd runs the backward on a thread of its own per device ("autograd thread"), and each
    collective shows twice: nccl's CPU-side record of the call, and its kernel on a stream. The kernel is
    what moved the bytes, so only kernels count there; on CPU ranks gloo's own threads hold the calls."""
    events = [event for event in json.loads(Path(path).read_text())["traceEvents"] if event.get("ph") == "X"]
    # With CUDA, each step is annotated on the GPU's timeline too ("gpu_user_annotation"): the CPU's is the loop's.
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path} holds no profiled step: was prof.step() called inside the profile block?")
    chosen = steps[-1] if step is None else next(e for e in steps if e["name"] == step)
    start, end, loop = chosen["ts"], chosen["ts"] + chosen["dur"], chosen["tid"]
    inside = [e for e in events if start <= e["ts"] < end]
    collectives = [e for e in inside if COLLECTIVE.search(e["name"])]
    if any(e.get("cat") == "kernel" for e in collectives):
        collectives = [e for e in collectives if e.get("cat") == "kernel"]
    communication = sorted({str(e["tid"]) for e in collectives})
    spans = [Span(e["name"], f"communication {communication.index(str(e['tid']))}", (e["ts"] - start) / 1e3,
                  e["dur"] / 1e3) for e in collectives]
    for event in inside:
        phase = next((phase for prefix, phase in PHASES if event["name"].startswith(prefix)), None)
        if phase:
            thread = "training loop" if event["tid"] == loop else "autograd thread"
            spans.append(Span(phase, thread, (event["ts"] - start) / 1e3, event["dur"] / 1e3))
    return sorted(spans, key=lambda span: (span.thread, span.start_ms)), chosen["dur"] / 1e3
