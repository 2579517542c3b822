"""How big a machine a workshop needs: what one learner's kernel holds in memory with its warm process, and how long
lesson 0 takes when 1, 4 or 8 learners run it at the same time on this machine.

    python benchmarks/workshop_sizing.py [--learners 1 4 8] [--json out.json]

Each learner is a kernel of its own (as JupyterHub gives each learner a server and each notebook a kernel) running
lesson 0 from its first cell to its last, as nbmake does, all started together. Printed per count: the median and
the slowest learner's lesson time and first launch (the hello cell: what a learner waits for after pressing
Shift-Enter), both as ratios to one learner alone; and, for one learner, the memory of the kernel and every process
under it once lesson 0 has run (its warm process included) as PSS, each shared page split between its sharers, so
that the figures add up across learners. The README's sizing guidance comes from this script's output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "00_check_setup.ipynb"


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (/proc/PID/smaps_rollup), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        found.append(current)
        frontier += children.get(current, [])
    return found


def run_lesson(runs: Path, start_at: float, measure_memory: bool) -> dict:
    """One learner (this process): a kernel of its own, ready before `start_at`; then lesson 0, cell by cell."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(LESSON, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(LESSON.parent)}})
    with client.setup_kernel(env={**os.environ, "DDP_HELPERS_RUNS": str(runs)}):
        time.sleep(max(0.0, start_at - time.time()))
        began, first_launch = time.perf_counter(), None
        for cell_index, cell in enumerate(notebook.cells):
            cell_began = time.perf_counter()
            client.execute_cell(cell, cell_index)
            if first_launch is None and cell.cell_type == "code" and cell.source.startswith("%%torchrun"):
                first_launch = time.perf_counter() - cell_began
        lesson = time.perf_counter() - began
        memory = (sum(pss_bytes(pid) for pid in descendants(client.km.provisioner.process.pid))
                  if measure_memory else None)
    return {"lesson_s": lesson, "first_launch_s": first_launch, "pss_bytes": memory}


def measure(learners: int) -> list[dict]:
    """`learners` processes, one learner each, started together (their kernels up first, as a room logged in)."""
    import subprocess

    start_at = time.time() + 10 + 2 * learners
    with tempfile.TemporaryDirectory(prefix="ddp-lessons-sizing-") as folder:
        processes = [subprocess.Popen([sys.executable, __file__, "--learner", str(Path(folder) / f"learner{i}"),
                                       "--start-at", repr(start_at)] + (["--memory"] if learners == 1 else []),
                                      stdout=subprocess.PIPE, text=True) for i in range(learners)]
        outputs = [process.communicate()[0] for process in processes]
    if any(process.returncode for process in processes):
        raise SystemExit("a learner did not finish lesson 0: run it alone (scripts/launch_lesson.sh 0) to see why")
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--learner", type=Path, help=argparse.SUPPRESS)  # one learner's process: its runs folder
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.learner:
        print(json.dumps(run_lesson(args.learner, args.start_at, args.memory)))
        return
    print(f"{os.cpu_count()} cores, lesson 0 per learner, all started together", flush=True)
    report, alone = {}, None
    for count in sorted(set(args.learners)):
        results = measure(count)
        lessons = sorted(r["lesson_s"] for r in results)
        launches = sorted(r["first_launch_s"] for r in results)
        row = {"median_lesson_s": statistics.median(lessons), "slowest_lesson_s": lessons[-1],
               "median_first_launch_s": statistics.median(launches), "slowest_first_launch_s": launches[-1]}
        if count == 1:
            alone, row["pss_bytes"] = row, results[0]["pss_bytes"]
            print(f"one learner's kernel with its warm process, after lesson 0: {row['pss_bytes'] / 2**20:.0f} MiB (PSS)")
        ratio = (f"  ({row['median_lesson_s'] / alone['median_lesson_s']:.1f}x alone; first launch "
                 f"{row['median_first_launch_s'] / alone['median_first_launch_s']:.1f}x)") if alone else ""
        print(f"{count:2d} learner(s): lesson 0 median {row['median_lesson_s']:.1f} s, slowest {row['slowest_lesson_s']:.1f} s; "
              f"first launch median {row['median_first_launch_s']:.1f} s, slowest {row['slowest_first_launch_s']:.1f} s{ratio}",
              flush=True)
        report[count] = row
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
