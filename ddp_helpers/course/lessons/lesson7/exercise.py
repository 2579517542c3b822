"""Lesson 7's exercise, the rank's side: the model, each rank's data, and the notes the checker reads.

The script trains a small MLP for STEPS steps of SGD, each rank on its own share of the step's batch (drawn
from its secret, `ddp_helpers.rank_secret`: no rank can compute another's gradient), with the learner's
`MyDDP`: gradients in buckets of about BUCKET_CAP_BYTES, in reverse order, each all-reduced as soon as its
last gradient is ready, averaged, and waited for before the step. `exercise_model()` notes for the checker,
step by step, when each gradient was accumulated (hooks registered before the learner's, so they run first:
post-accumulate-grad hooks run in registration order, `torch/_tensor.py`), when the rank waited for a
collective (`Work.wait`, and a future's `wait`), when the optimizer stepped, and whether torch's own
`Reducer` (DDP's engine) was built. The checker is `lesson7_checker`.
"""

from __future__ import annotations

import time

from ...exercises import regression_teacher, train_on_every_share
from ....recording import rank_secret, record

STEPS = 20
BATCH = 32  # per rank and step
LEARNING_RATE = 0.05
INPUTS, HIDDEN = 32, 64
BUCKET_CAP_BYTES = 16 * 1024
# Float32's summation order: the ranks' sum of their shares' gradients against one process's gradient of the
# whole batch differ by rounding only (about 1e-6 of the distance trained here); a wrong average, a lost
# bucket or a stale gradient moves the weights by 10 % or more.
WEIGHT_TOLERANCE = 1e-3
BACKWARD_FACT = "exercise_backward_ns"  # recorded by the hooks exercise_model() installs


def plain_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 1))


def exercise_model():
    """The model every rank starts from (seeded: the same weights on every rank). It also takes notes for the
    checker, step by step: when each gradient was accumulated, when the rank waited for a collective, when
    the optimizer stepped (recorded then, as BACKWARD_FACT)."""
    model = plain_model()
    steps: list[dict] = []
    notes = _install_notes()

    def accumulated(_parameter):
        if not steps or "stepped_ns" in steps[-1]:
            steps.append({"accumulated_ns": []})
        steps[-1]["accumulated_ns"].append(time.time_ns())

    def stepping(_optimizer, _args, _kwargs):
        if steps and "stepped_ns" not in steps[-1]:
            steps[-1]["stepped_ns"] = time.time_ns()
            first = steps[-1]["accumulated_ns"][0]
            steps[-1]["waited"] = [[t, kind] for t, kind in notes["waited"] if t >= first]
            record(BACKWARD_FACT, {"steps": steps, "reducers_built": notes["reducers_built"]})

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(accumulated)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(stepping)
    return model


_NOTES: dict = {"waited": [], "reducers_built": 0}  # waited: [time.time_ns(), "work" or "future"]


def _install_notes() -> dict:
    """Note (once per process) every wait for a collective (`Work.wait()`, which a blocking `dist.all_reduce`
    calls too, and a future's `wait()`), every `torch.distributed.Reducer` built (DDP builds one), and the sum
    of what each `dist.all_reduce` was handed (`records.RankRecords.all_reduced`)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Work

    from ... import _all_reduce_log

    _all_reduce_log.log_sums = True  # what each all-reduce carried: the checker compares with each rank's gradients

    # A work's wait covers that one collective; a future's (torch.futures.wait_all, get_future().wait()) may
    # cover many: the checker counts the former and takes the latter as covering all before it.
    for cls, kind in ((Work, "work"), (torch._C.Future, "future")):
        if not getattr(cls.wait, "_noted", False):
            def wait(self, *args, _original=cls.wait, _kind=kind, **kwargs):
                _NOTES["waited"].append([time.time_ns(), _kind])
                return _original(self, *args, **kwargs)

            wait._noted = True
            cls.wait = wait
    if not getattr(dist.Reducer, "_noted", False):
        def reducer(*args, _original=dist.Reducer, **kwargs):
            _NOTES["reducers_built"] += 1
            return _original(*args, **kwargs)

        reducer._noted = True
        dist.Reducer = reducer
    return _NOTES


def exercise_batch(step: int, secret: int):
    """The share of step `step`'s batch of the rank whose secret is `secret`: (inputs, targets)."""
    import torch

    inputs = torch.randn(BATCH, INPUTS, generator=torch.Generator().manual_seed((secret + 7919 * step) % 2**63))
    with torch.no_grad():
        return inputs, regression_teacher(INPUTS)(inputs)


def my_batch(step: int):
    """In a rank: this rank's share of step `step`'s batch, from the secret only this rank's process is handed."""
    return exercise_batch(step, rank_secret())


def local_gradients(secrets: list[int]) -> list[list[list]]:
    """Each step's gradients of each rank's own share (its mean loss), at the intended training's weights before
    that step: [step][rank][parameter]. What each rank's all-reduces must carry (scaled by 1/W, or not)."""
    import torch

    model = plain_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    steps = []
    for step in range(STEPS):
        shares = [exercise_batch(step, secret) for secret in secrets]
        per_rank = []
        for inputs, targets in shares:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            per_rank.append([p.grad.detach().clone() for p in model.parameters()])
        steps.append(per_rank)
        with torch.no_grad():  # the step on the whole batch: the mean of the equal shares' gradients
            for index, parameter in enumerate(model.parameters()):
                parameter.grad = torch.stack([grads[index] for grads in per_rank]).mean(0)
        optimizer.step()
    return steps


def exercise_reference(secrets: list[int], summed: bool = False) -> list:
    """The weights after the intended training on ranks with these secrets, in one process: each step's
    gradient is the mean loss's over every rank's share. `summed`: the ranks' gradients added, not averaged."""
    return train_on_every_share(plain_model(), lambda step: [exercise_batch(step, secret) for secret in secrets],
                                STEPS, LEARNING_RATE * (len(secrets) if summed else 1))
