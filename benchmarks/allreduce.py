"""What an all-reduce costs on this machine: time, algorithm and bus bandwidth per payload (as nccl-tests
define them), and the alpha-beta model fitted to the points.

    python benchmarks/allreduce.py [--nproc 2] [--max-mib 64] [--repeats 10] [--json out.json] [--plot out.png]

Runs on the backend present: nccl with one rank per GPU, else gloo on CPU processes (2 by default).
On GPUs it is the check an instructor runs on a box before a workshop: it also prints the bus bandwidth
as a share of the GPUs' NVLink bandwidth, where `nvidia-smi nvlink --status` reports it (otherwise it
says the peak is unknown rather than guess).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ddp_helpers import launch, make_launch_config
from ddp_helpers.course.lessons.lesson6 import RANK_SCRIPT, bandwidths, fit_alpha_beta, human_bytes, table


def nvlink_bandwidth_per_gpu() -> float | None:
    """Bytes per second one GPU's NVLinks carry in one direction (the sum of its links' speeds), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        status = subprocess.run(["nvidia-smi", "nvlink", "--status", "-i", "0"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    speeds = [float(speed) for speed in re.findall(r"Link \d+: ([\d.]+) GB/s", status)]
    return sum(speeds) * 1e9 if speeds else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, else 2 CPU ranks)")
    parser.add_argument("--max-mib", type=float, default=64, help="largest payload, MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per payload (default 10)")
    parser.add_argument("--json", type=Path, help="write the points and the fit here")
    parser.add_argument("--plot", type=Path, help="save the plot here (PNG)")
    args = parser.parse_args(argv)

    config = make_launch_config(RANK_SCRIPT, nproc=args.nproc, stream=False, timeout_s=600,
                                extra_env={"ALLREDUCE_MAX_BYTES": str(int(args.max_mib * (1 << 20))),
                                           "ALLREDUCE_REPEATS": str(args.repeats)})
    run = launch(config)
    run.raise_for_failure()
    recorded = run.ranks[0].facts  # rank 0 records the slowest rank's time per payload
    points, world_size, backend = recorded["allreduce"], recorded["world_size"], recorded["backend"]
    try:
        fit = fit_alpha_beta(points)
    except ValueError as error:  # noise larger than the bytes' cost: say so, with the points, rather than fit
        for point in points:
            print(f"{human_bytes(point['bytes']):>10}  {point['seconds'] * 1e6:>10.1f} us")
        print(f"No alpha-beta fit: {str(error).split(':')[0]}. The payloads are too small for this machine's noise: "
              "run again with a larger --max-mib or more --repeats.", file=sys.stderr)
        return 1
    print(f"all_reduce of float32 on {world_size} ranks ({backend}), median of {args.repeats} per payload, "
          "the slowest rank's:")
    print(table(points, world_size, fit))
    print(f"alpha-beta fit: latency alpha = {fit.alpha_s * 1e6:.1f} us, bandwidth beta = "
          f"{fit.beta_bytes_per_s / 1e9:.3f} GB/s (algorithm bandwidth of a large payload)")
    largest = bandwidths(points, world_size)[-1]
    peak = nvlink_bandwidth_per_gpu() if backend == "nccl" else None
    if peak:
        print(f"bus bandwidth at {human_bytes(largest['bytes'])}: {largest['busbw'] / 1e9:.1f} GB/s, "
              f"{largest['busbw'] / peak:.0%} of one GPU's NVLink bandwidth ({peak / 1e9:.0f} GB/s, nvidia-smi)")
    else:
        print(f"bus bandwidth at {human_bytes(largest['bytes'])}: {largest['busbw'] / 1e9:.3f} GB/s; the link's "
              "peak is unknown here (" + ("no NVLink reported by nvidia-smi" if backend == "nccl" else
                                           "CPU processes on one machine: their 'link' is memory copies") + ")")
    if args.json:
        args.json.write_text(json.dumps({"world_size": world_size, "backend": backend, "points": points,
                                         "alpha_s": fit.alpha_s, "beta_bytes_per_s": fit.beta_bytes_per_s,
                                         "peak_bytes_per_s": peak}, indent=1))
    if args.plot:
        from ddp_helpers.course.lessons.lesson6.plots import plot_allreduce

        plot_allreduce(points, world_size, fit).savefig(args.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
