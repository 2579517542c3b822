"""What lesson 1's schedule cell measures in each stage, kept out of the cell (it is instrumentation, not the
lesson): when the stage ran each micro-batch's forward and backward (`Timeline`), and the activations autograd holds
for backward (`HeldForBackward`, from the course's `_held_activations`, which the exercise's checker reads the same
way).

Rank side: imported by the cell in each rank.
"""

from __future__ import annotations

import time

from ..._held_activations import HeldForBackward

__all__ = ["HeldForBackward", "Timeline"]


class Timeline:
    """When a stage ran each micro-batch's forward and backward, in seconds from the step's start (`restart`).

    A forward runs from the stage module's forward pre-hook to its forward hook. A backward starts when the gradient
    of the stage's output arrives (a hook on that output) and ends when the first layer's weight has its gradient
    (the last the stage computes). On a GPU each moment is taken after a synchronize: GPU work is asynchronous."""

    def __init__(self, stage_module, device, first_weight):
        self.pieces, self.start, self.device = [], 0.0, device
        stage_module.register_forward_pre_hook(lambda module, args: self._begin("forward"))
        stage_module.register_forward_hook(self._forward_ended)
        first_weight.register_post_accumulate_grad_hook(lambda weight: self._end())

    def restart(self):
        self.pieces, self.start = [], time.perf_counter()

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()  # GPU work is asynchronous: time it to its end
        return time.perf_counter() - self.start

    def _begin(self, kind):
        self.pieces.append({"kind": kind, "start": self._now()})

    def _end(self):
        self.pieces[-1]["end"] = self._now()

    def _forward_ended(self, module, args, output):
        self._end()
        if output.requires_grad:  # this micro-batch's backward here starts when its output's gradient arrives
            output.register_hook(lambda grad: self._begin("backward"))
