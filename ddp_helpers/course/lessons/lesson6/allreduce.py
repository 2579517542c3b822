"""The all-reduce benchmark every rank runs (`benchmarks/allreduce.py`, and lesson 6's first cell).

For each payload, from 1 KiB up to MAX_BYTES (powers of 4), in float32: a few warm-up all-reduces,
then REPEATS timed ones; a rank's time for the payload is its median. The collective's time is the
slowest rank's (the all-reduce is not done until every rank has its result), as nccl-tests report it
with `-a 3` (their default, `-a 1`, averages over the ranks).
Rank 0 records [{"bytes", "seconds"}] as "allreduce".
"""

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_helpers import record

MAX_BYTES = int(os.environ.get("ALLREDUCE_MAX_BYTES", str(64 << 20)))
REPEATS = int(os.environ.get("ALLREDUCE_REPEATS", "10"))
WARMUP = 3

local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=120))


def synchronize() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # nccl's all_reduce returns at once: time it to its end


points = []
size = 1 << 10
while size <= MAX_BYTES:
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    for _ in range(WARMUP):
        dist.all_reduce(tensor)
    synchronize()
    times = []
    for _ in range(REPEATS):
        dist.barrier()  # every rank starts each timed all-reduce together
        start = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    points.append({"bytes": size, "seconds": slowest.item()})
    size *= 4

if dist.get_rank() == 0:
    record("allreduce", points)
    record("world_size", dist.get_world_size())
    record("backend", dist.get_backend())
dist.destroy_process_group()
