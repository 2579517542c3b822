"""What the hang report costs a run that does not hang: torch's flight recorder on every collective, and
the probe thread every rank starts.

    python benchmarks/hang_report_cost.py [--repeats 5] [--collectives 2000]

Prints two ratios (target: within noise of 1.00):
- per collective: a 2-rank run of N small all_reduces with the flight recorder as torch 2.13 has it by
  default (TORCH_FR_BUFFER_SIZE=2000 entries) over the same run with it off (0), timed inside the ranks;
- per launch: a warm 2-rank launch of a trivial script (init, one all_reduce, destroy) with the probe
  thread over the same launch without it (DDP_LESSONS_HANG_PROBE_OFF=1).
Runs alternate between the two settings, so that drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ddp_helpers import launch, make_launch_config
from ddp_helpers._hang_probe import OFF_ENV
from ddp_helpers.default_job import prepare_warm_launches

COLLECTIVES = """
import sys, time
import torch, torch.distributed as dist
from ddp_helpers import record
dist.init_process_group("gloo")
t = torch.ones(16)
for _ in range(50):
    dist.all_reduce(t)  # warm-up
dist.barrier()
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    dist.all_reduce(t)
record("seconds", time.perf_counter() - start)
dist.destroy_process_group()
"""

TRIVIAL = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


def run(script: Path, env: dict, args: list[str] = ()):
    config = make_launch_config(script, nproc=2, backend="gloo", stream=False, extra_env=env, script_args=list(args))
    result = launch(config)
    result.raise_for_failure()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--collectives", type=int, default=2000)
    options = parser.parse_args()
    if not prepare_warm_launches():
        sys.exit("the warm process did not start")
    with tempfile.TemporaryDirectory() as folder:
        collectives, trivial = Path(folder) / "collectives.py", Path(folder) / "trivial.py"
        collectives.write_text(COLLECTIVES)
        trivial.write_text(TRIVIAL)
        per_call = {"2000": [], "0": []}
        per_launch = {"on": [], "off": []}
        for _ in range(options.repeats):
            for size in per_call:
                result = run(collectives, {"TORCH_FR_BUFFER_SIZE": size}, [str(options.collectives)])
                per_call[size].append(max(result.facts("seconds")) / options.collectives)
            for probe, env in (("on", {}), ("off", {OFF_ENV: "1"})):
                start = time.perf_counter()
                run(trivial, env)
                per_launch[probe].append(time.perf_counter() - start)
        on, off = statistics.median(per_call["2000"]), statistics.median(per_call["0"])
        print(f"all_reduce of 16 floats, 2 ranks: {on * 1e6:.1f} us with the flight recorder (2000 entries), "
              f"{off * 1e6:.1f} us without: ratio {on / off:.2f}")
        on, off = statistics.median(per_launch["on"]), statistics.median(per_launch["off"])
        print(f"warm 2-rank launch: {on:.3f} s with the probe thread, {off:.3f} s without: ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
