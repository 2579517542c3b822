"""Lesson 6's simulated network link, for a machine whose ranks share their cores (a laptop, CI): the time a
network spends moving bytes, which a network card spends without the CPU, as a sleep on a thread of its own."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


class SimulatedLink:
    """Each tensor handed to `send` is averaged over the ranks by a real all-reduce, then held for the time its
    bytes take at `bytes_per_s` on one thread of the link's own, which sleeps meanwhile (it uses no core), one
    tensor at a time, as one link carries them. `send` returns a torch Future that completes once the link has
    carried the tensor: what a DDP communication hook returns. `spans` notes each tensor's time on the link, in
    seconds from `started` (set it where the clock starts, at a backward's start)."""

    def __init__(self, device, bytes_per_s: float = float("inf")):
        import torch

        self.device, self.bytes_per_s = device, bytes_per_s
        self.started = 0.0
        self.spans: list[tuple[float, float]] = []
        # On GPUs the link's thread works on this rank's GPU (a new thread starts on GPU 0).
        on_gpu = device.type == "cuda"
        self._thread = ThreadPoolExecutor(max_workers=1,
                                          initializer=(lambda: torch.cuda.set_device(device)) if on_gpu else None)

    def send(self, tensor):
        import torch
        import torch.distributed as dist

        tensor.div_(dist.get_world_size())  # an average, as DDP's own all-reduce
        arrived = torch.futures.Future(devices=[self.device] if self.device.type == "cuda" else None)
        self._thread.submit(self._carry, tensor, dist.all_reduce(tensor, async_op=True), arrived)
        return arrived

    def _carry(self, tensor, work, arrived) -> None:
        try:
            while not work.is_completed():  # the real all-reduce between the ranks (on GPUs: done on the GPU)
                time.sleep(1e-4)
            work.wait()  # raises if it failed
            began = time.perf_counter()
            time.sleep(tensor.numel() * tensor.element_size() / self.bytes_per_s)
            self.spans.append((began - self.started, time.perf_counter() - self.started))
            arrived.set_result(tensor)
        except BaseException as error:  # a peer gone, a timeout: DDP's wait raises it rather than waiting forever
            arrived.set_exception(error)
