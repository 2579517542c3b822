"""What a launch costs: bare torchrun against the helper's cold and warm launches, on a trivial script
(init, one all_reduce, destroy) and on one DDP training step.

    python benchmarks/launch_overhead.py [--repeats 5] [--nproc 2 4]

Prints, per script and nproc, the median wall time of each and the ratios cold / bare (target <= 1.05)
and warm / bare (target <= 0.25). Launches alternate between the three so that drifting machine load
hits all alike. The warm process is started (and waited for) before timing.
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
from ddp_helpers.default_job import prepare_warm_launches

SCRIPTS = {
    "trivial": """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
""",
    "DDP step": """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 8)).pow(2).mean().backward()
optimizer.step()
dist.destroy_process_group()
""",
}


def time_bare_torchrun(script: Path, nproc: int) -> float:
    start = time.perf_counter()
    # Not checked: a bare DDP run often aborts at interpreter exit after its work is done (the abort the
    # helper's bootstrap designs out); the time to that point is what is compared.
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def time_helper_launch(script: Path, nproc: int, cold: bool) -> float:
    start = time.perf_counter()
    launch(make_launch_config(script, nproc=nproc, backend="gloo", stream=False, cold=cold)).raise_for_failure()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if not prepare_warm_launches():
        sys.exit("the warm process did not start")
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'script':>8}  {'nproc':>5}  {'bare s':>7}  {'cold s':>7}  {'warm s':>7}  {'cold/bare':>9}  {'warm/bare':>9}")
        for name, source in SCRIPTS.items():
            script = Path(folder) / f"{name.replace(' ', '_')}.py"
            script.write_text(source)
            time_helper_launch(script, 2, cold=True)  # warm the file cache for all three
            for nproc in args.nproc:
                bare, cold, warm = [], [], []
                for _ in range(args.repeats):
                    bare.append(time_bare_torchrun(script, nproc))
                    cold.append(time_helper_launch(script, nproc, cold=True))
                    warm.append(time_helper_launch(script, nproc, cold=False))
                b, c, w = (statistics.median(times) for times in (bare, cold, warm))
                print(f"{name:>8}  {nproc:>5}  {b:>7.2f}  {c:>7.2f}  {w:>7.2f}  {c / b:>9.2f}  {w / b:>9.2f}")


if __name__ == "__main__":
    main()
