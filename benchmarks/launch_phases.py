"""Where a warm launch's time goes, phase by phase, beside the physical floor (issue 40: measure first).

    python benchmarks/launch_phases.py [--repeats 7] [--nproc 2]

The launched script does the floor's work and no more: gloo init on loopback, a barrier, exit. Each
phase ends at a moment the run itself records, so nothing is instrumented for the measurement:
- kernel side: `launch()` called -> the supervisor's spec written (the run folder claimed and emptied,
  the environment built, the warm process asked);
- supervisor, agent, rendezvous, workers forked: -> the first rank's bootstrap writes its identity;
- bootstrap to script: -> the script's first line runs (it prints time.time());
- the script (init, barrier, destroy): -> its last line runs;
- rank end: -> the last rank's bootstrap writes its exit code (evidence, interpreter finalisation);
- agent end: -> the supervisor writes the outcome (torchrun's monitor and exit barrier, the sweep);
- kernel side again: -> `launch()` returns (read-back, the output's last lines, teardown).

A file's time is the kernel's coarse clock (a few milliseconds behind `time.time()`): a phase is good to
about 5 ms. The floor: 2 processes forked from this one (torch imported), gloo init on 127.0.0.1, barrier, exit,
timed in the same run. Prints each phase's median, the launch's median, the floor's, and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ddp_helpers import launch, make_launch_config
from ddp_helpers.default_job import prepare_warm_launches
from ddp_helpers.run_folder import RunFolder

SCRIPT = """
import time
print("first line", time.time(), flush=True)
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
print("last line", time.time(), flush=True)
"""
PHASES = ("kernel side, before the supervisor", "supervisor, agent, rendezvous, workers forked",
          "bootstrap to the script's first line", "the script: init, barrier, destroy", "rank end: evidence, exit",
          "agent end: monitor, exit barrier, sweep", "kernel side, after: read-back, teardown")


def _stamp(stdout: str, label: str) -> float:
    return float(next(line.split()[-1] for line in stdout.splitlines() if line.startswith(label)))


def one_launch(script: Path, nproc: int) -> tuple[float, list[float]]:
    """(the launch's wall time, each phase's seconds)."""
    called = time.time()
    run = launch(make_launch_config(script, nproc=nproc, backend="gloo", stream=False)).raise_for_failure()
    returned = time.time()
    folder = RunFolder(run.config.run_dir, run.run_id)
    moments = [called, folder.supervisor_spec.stat().st_mtime,
               min(folder.identity_file(r).stat().st_mtime for r in range(nproc)),
               min(_stamp(r.stdout, "first line") for r in run.ranks),
               max(_stamp(r.stdout, "last line") for r in run.ranks),
               max(folder.exit_file(r).stat().st_mtime for r in range(nproc)),
               folder.outcome_file.stat().st_mtime, returned]
    return returned - called, [later - earlier for earlier, later in zip(moments, moments[1:])]


def _floor_rank(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def one_floor(nproc: int) -> float:
    with socket.socket() as probe:  # a free port on loopback for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    start = time.perf_counter()
    ranks = [fork.Process(target=_floor_rank, args=(rank, nproc, port)) for rank in range(nproc)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise RuntimeError(f"a floor rank failed: {[process.exitcode for process in ranks]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    if not prepare_warm_launches():
        sys.exit("the warm process did not start")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "barrier.py"
        script.write_text(SCRIPT)
        one_launch(script, args.nproc)  # caches warm, the run folder made
        walls, phases, floors = [], [], []
        for _ in range(args.repeats):  # alternating, so that drifting load hits both alike
            wall, spans = one_launch(script, args.nproc)
            walls.append(wall)
            phases.append(spans)
            floors.append(one_floor(args.nproc))
    print(f"a warm {args.nproc}-rank launch of init, barrier, exit; medians of {args.repeats}")
    for index, name in enumerate(PHASES):
        print(f"  {name:<48} {statistics.median(p[index] for p in phases) * 1e3:8.1f} ms")
    wall, floor = statistics.median(walls), statistics.median(floors)
    print(f"  {'the whole launch':<48} {wall * 1e3:8.1f} ms")
    print(f"the floor (fork {args.nproc} from a process with torch imported, gloo init, barrier, exit): {floor * 1e3:.1f} ms")
    print(f"launch / floor: {wall / floor:.1f}x (issue 40's target: 4x)")


if __name__ == "__main__":
    main()
