"""Rank side of the hang report: what this rank is waiting in, written when the launcher asks.

When a run times out, the launcher writes into each live rank's named pipe (`RunFolder.hang_request`); a
daemon thread of the bootstrap, blocked reading that pipe until then, answers (`write_hang_answer`). A thread can
answer while the main thread waits in a collective: torch releases the interpreter lock there. While a run is
silent, the launcher's waiting line asks a quieter question (PEEK): which collectives have not finished, with
no stack dump and no flight-recorder file, so that a run that then ends well leaves nothing of it behind.

What it writes comes from torch's flight recorder, which torch 2.13 keeps by default for gloo and nccl
alike (2000 entries, `TORCH_FR_BUFFER_SIZE`; torch/csrc/distributed/c10d/FlightRecorder.hpp), read with
`torch._C._distributed_c10d._dump_fr_trace`: each collective's sequence number per process group, name,
input shapes and dtypes, and whether it has returned ("retired"). Gloo's send and recv are not in it,
so the blocking send or recv the script is in comes from the bootstrap's own log (`_point_to_point`).
The raw dump is kept too (`RunFolder.flight_recorder_dump`), in the layout torch's analyser reads
(`torchfrtrace`, pointed at that folder with `--prefix rank`).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import sys
import threading
import time

from . import _point_to_point
from .run_folder import RunFolder, write_atomically

# How often the probe looks whether the script has made its process group yet (`_prepare_the_dump`).
PREPARE_POLL_S = 0.25
KEEP_COLLECTIVES = 8  # the last few per rank: enough to see where ranks part ways
OFF_ENV = "DDP_LESSONS_HANG_PROBE_OFF"  # "1": no probe thread (benchmarks/hang_report_cost.py compares)
# "file": the launcher asks by writing a file, not into a named pipe (a cluster job's ranks, on other machines; see `_FileRequests`).
REQUESTS_ENV = "DDP_HELPERS_HANG_REQUESTS"
# What the launcher writes to ask: REPORT for the hang report (stacks, the recorder's dump), PEEK for the waiting
# line's question (unfinished collectives only). Requests that pile up are answered once, the report first.
REPORT, PEEK = b"?", b"p"


def serve(folder: RunFolder, rank: int, stack_file) -> None:
    requests = _FileRequests(folder.hang_request(rank)) if os.environ.get(REQUESTS_ENV) == "file" else \
        _PipeRequests(folder.hang_request(rank))
    threading.Thread(target=_answer_requests, args=(folder, rank, requests, stack_file),
                     name="ddp_helpers-hang-probe", daemon=True).start()
    threading.Thread(target=_prepare_the_dump, name="ddp_helpers-hang-probe-prepare", daemon=True).start()


# Set once the first dump with stack traces is done (`_prepare_the_dump`): from then on an answer names the
# script's line of each collective at no cost; before, it leaves them out rather than answer late.
_prepared = threading.Event()


class _PipeRequests:
    """Requests through a named pipe in the run folder (this machine): the thread wakes as one is written."""

    def __init__(self, path):
        path.unlink(missing_ok=True)  # an earlier attempt's, before a restart
        os.mkfifo(path, 0o600)
        # Opened here, read and write (which never blocks on Linux), so that the rank holds the same
        # descriptors whatever the thread is doing: an open() blocked in a thread reserves a descriptor
        # number unseen, and the script's first file would get another number from one run to the next.
        self._pipe = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def pending(self, wait_s: float | None) -> bool:
        return bool(select.select([self._pipe], [], [], wait_s)[0])

    def take(self) -> bytes:
        return os.read(self._pipe, 64)


class _FileRequests:
    """Requests as a file in the run folder (a cluster job's ranks: a named pipe does not cross machines on a
    shared file system), looked for every PREPARE_POLL_S."""

    def __init__(self, path):
        self._path = path
        path.unlink(missing_ok=True)

    def pending(self, wait_s: float | None) -> bool:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not self._path.exists():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(PREPARE_POLL_S)
        return True

    def take(self) -> bytes:
        try:
            asked = self._path.read_bytes()
        except OSError:
            asked = REPORT
        self._path.unlink(missing_ok=True)
        return asked or REPORT


def _answer_requests(folder: RunFolder, rank: int, requests, stack_file) -> None:
    while True:
        try:
            requests.pending(None)  # blocks until the launcher asks
            asked = requests.take()
            if REPORT not in asked:
                folder.write_peek_answer(rank, _unfinished(rank))
                continue
            # Every thread's stack first, from this thread: a signal (SIGUSR1) is the script's to own, and
            # a handler of its own (a preemption checkpoint) would run instead of the dump. While this
            # thread holds the interpreter lock, no other thread's frames change under the dump.
            faulthandler.dump_traceback(file=stack_file, all_threads=True)
            stack_file.flush()
            folder.write_hang_answer(rank, _what_this_rank_waits_in(folder, rank, with_lines=_prepared.is_set()))
        except Exception as error:  # noqa: BLE001 - the report is a courtesy: it must never end the rank
            print(f"[ddp_helpers] the hang report of rank {rank} failed: {error!r}", file=sys.stderr)
            return


def _prepare_the_dump() -> None:
    """Once the script has a process group, dump the flight recorder with stack traces once and throw the dump
    away: the first such dump imports what torch needs to name their lines (torch._dynamo and sympy, some 800
    modules: 2-4 s in a cold rank, far more on a loaded machine). Its own thread, so that an answer never waits
    for it: one asked before it is done leaves the lines out (the report then takes them from the stacks). A
    warm rank has the modules imported already (the warm process did)."""
    while True:
        time.sleep(PREPARE_POLL_S)
        is_initialized = getattr(sys.modules.get("torch.distributed"), "is_initialized", None)  # None while it loads
        try:
            if is_initialized is None or not is_initialized():
                continue
            for dump_trace in _recorders():
                dump_trace(True, True, False)
        except Exception:  # noqa: BLE001 - only a preparation: the answer will say what fails
            pass
        _prepared.set()
        return


def _unfinished(rank: int) -> dict:
    """The waiting line's answer: the rank's last few collectives (no stack traces: a fast dump) and its
    blocking point-to-point call, if any."""
    collectives = [{**_collective(entry), "returned": bool(entry["retired"])}
                   for dump_trace in _recorders()
                   for entry in pickle.loads(dump_trace(True, False, False)).get("entries", [])[-KEEP_COLLECTIVES:]
                   if not entry.get("is_p2p")]
    return {"rank": rank, "collectives": collectives,
            "point_to_point": _point_to_point.waiting or _point_to_point.unfinished(), "recorder": _recorder_is_on()}


def _what_this_rank_waits_in(folder: RunFolder, rank: int, with_lines: bool = True) -> dict:
    collectives = []
    for dump_trace in _recorders():
        # With stack traces (once prepared): the line of the script that called each collective.
        dump = pickle.loads(dump_trace(True, with_lines, False))  # collectives, not only the active ones
        if not dump.get("entries"):
            continue
        write_atomically(folder.flight_recorder_dump(rank), pickle.dumps(_analysable(dump)))
        collectives += [{**_collective(entry), "returned": bool(entry["retired"]),
                         "line": _script_line(entry.get("frames") or [])}
                        for entry in dump["entries"][-KEEP_COLLECTIVES:] if not entry.get("is_p2p")]
    return {"collectives": collectives, "point_to_point": _point_to_point.waiting or _point_to_point.unfinished(),
            "recorder": _recorder_is_on()}


def _recorder_is_on() -> bool:
    """torch's flight recorder keeps TORCH_FR_BUFFER_SIZE entries (2000 by default); 0 turns it off."""
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "2000")) > 0
    except ValueError:
        return True


def collectives_called() -> list[dict]:
    """Every collective the rank called, as the flight recorder holds them (its last 2000), in order;
    the bootstrap writes them when the script has ended, for checkers (no stack traces: fast)."""
    return [_collective(entry) for dump_trace in _recorders()
            for entry in pickle.loads(dump_trace(True, False, False)).get("entries", []) if not entry.get("is_p2p")]


def _recorders() -> list:
    c10d = sys.modules.get("torch._C._distributed_c10d")  # never import torch here: a script may not use it
    # nccl's groups keep their own recorder (a CUDA build's `_dump_nccl_trace`; not run on a machine
    # without GPUs), gloo's the generic one.
    return [getattr(c10d, name) for name in ("_dump_nccl_trace", "_dump_fr_trace") if hasattr(c10d, name)] if c10d else []


def _collective(entry: dict) -> dict:
    group_name, group_description = entry["process_group"]
    if group_description == "default_pg":
        group = "world"
    elif group_description in ("", "undefined"):  # dist.new_group() without group_desc
        group = f"group {group_name}"
    else:
        group = group_description
    return {"number": entry["collective_seq_id"], "op": entry["profiling_name"].split(":", 1)[-1],
            "shapes": entry["input_sizes"], "dtypes": [d.lower() for d in entry["input_dtypes"]], "group": group,
            "started_ns": entry.get("time_created_ns")}


def _script_line(frames: list[dict]) -> int | None:
    """The line of the rank's script (the cell) in a collective's call stack, innermost first."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return next((frame["line"] for frame in frames if frame.get("filename") == script), None)


def _analysable(dump: dict) -> dict:
    """The dump as torch's analyser needs it: torch 2.13's gloo lists its groups' configuration under the
    name "" while its entries name the group ("0"), and `torchfrtrace` then stops with a KeyError."""
    config = dict(dump.get("pg_config") or {})
    unnamed = config.get("")
    for name, description in {tuple(entry["process_group"]) for entry in dump.get("entries", [])}:
        if name not in config and unnamed is not None:
            config[name] = {**unnamed, "name": name, "desc": description}
    return {**dump, "pg_config": config}
