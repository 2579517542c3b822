"""How much the helper launch costs over a bare torchrun, on the same trivial script.

    python benchmarks/launch_overhead.py [--repeats 5] [--nproc 2 4]

Prints, per nproc, the median wall time of each and the ratio helper / bare (target <= 1.05).
Launches alternate between the two so that drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_helpers import launch, make_launch_config

TRIVIAL_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def time_bare_torchrun(script: Path, nproc: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def time_helper_launch(script: Path, nproc: int) -> float:
    start = time.perf_counter()
    launch(make_launch_config(script, nproc=nproc, backend="gloo", stream=False)).raise_for_failure()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "trivial.py"
        script.write_text(TRIVIAL_SCRIPT)
        time_helper_launch(script, 2)  # warm the file cache for both
        print(f"{'nproc':>5}  {'bare torchrun s':>15}  {'helper s':>9}  {'ratio':>6}")
        for nproc in args.nproc:
            bare, helper = [], []
            for _ in range(args.repeats):
                bare.append(time_bare_torchrun(script, nproc))
                helper.append(time_helper_launch(script, nproc))
            ratio = statistics.median(helper) / statistics.median(bare)
            print(f"{nproc:>5}  {statistics.median(bare):>15.2f}  {statistics.median(helper):>9.2f}  {ratio:>6.2f}")


if __name__ == "__main__":
    main()
