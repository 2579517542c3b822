"""Lesson 7's exercise: complete `MyDDP`, bucketed and overlapped, and have it judged on what the run did.

The script trains a small MLP for STEPS steps of SGD, each rank on its own share of the step's batch, with
the learner's `MyDDP`: gradients grouped into buckets of at most about BUCKET_CAP_BYTES, in reverse order,
each bucket all-reduced as soon as its last gradient is ready, averaged, and waited for before the step.
The checker computes the intended training itself, in one process (`exercise_reference`), and judges:
- the weights: every rank's bitwise equal, and the reference's to float32's summation order (WEIGHT_TOLERANCE
  of how far training moved them); a sum instead of an average is named (the weights are then those of a
  W times larger step);
- the buckets: every gradient all-reduce over the whole run, as torch's flight recorder saw it, grouped
  step by step as one of the two readings of "buckets up to a cap" (`accepted_buckets`);
- the overlap: in every step, an all-reduce created (the flight recorder's clock) while the backward was
  still accumulating gradients. The backward's start and end come from hooks `exercise_model()` installs
  on every parameter before the learner's code runs: it registered first, so its hook runs before the
  learner's on the same parameter (`register_post_accumulate_grad_hook` runs hooks in order);
- nothing crossing outside the collectives (a key-value store, point-to-point sends, files), no other
  collective moving gradients' bytes, and torch's DistributedDataParallel not wrapped inside (its wrap
  checks the parameters across ranks: an all_gather of one int64, then a broadcast of int64 metadata).

Each rank's share comes from its secret (`ddp_helpers.rank_secret`), so no rank can compute another's gradient.
"""

from __future__ import annotations

import functools
import math
import os
import time

from ..exercises import ExerciseReport, rank_secrets, side_channels
from ..flight_recorder import ALL_REDUCE_OPS
from ..recording import rank_secret, record
from ..result import RunResult

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


def _plain_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 1))


def exercise_model():
    """The model every rank starts from (seeded: the same weights on every rank). It notes when each backward
    starts and ends (the first and the last gradient accumulated) for the checker: the overlap is judged
    against those times."""
    model = _plain_model()
    parameters = list(model.parameters())
    times: list[list[int]] = []
    accumulated = [0]

    def note(_parameter):
        now = time.time_ns()
        if accumulated[0] % len(parameters) == 0:
            times.append([now, now])
        times[-1][1] = now
        accumulated[0] += 1
        if accumulated[0] % len(parameters) == 0:
            record(BACKWARD_FACT, times)

    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(note)
    return model


@functools.cache  # one teacher for every batch: it is fixed by its seed
def _teacher():
    import torch

    generator = torch.Generator().manual_seed(1)
    teacher = torch.nn.Sequential(torch.nn.Linear(INPUTS, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return teacher


def exercise_batch(step: int, secret: int):
    """The share of step `step`'s batch of the rank whose secret is `secret`: (inputs, targets)."""
    import torch

    inputs = torch.randn(BATCH, INPUTS, generator=torch.Generator().manual_seed((secret + 7919 * step) % 2**63))
    with torch.no_grad():
        return inputs, _teacher()(inputs)


def my_batch(step: int):
    """In a rank: this rank's share of step `step`'s batch, from the secret only this rank's process is handed."""
    return exercise_batch(step, rank_secret())


def exercise_reference(secrets: list[int], summed: bool = False) -> list:
    """The weights after the intended training on ranks with these secrets, in one process: each step's
    gradient is the mean loss's over every rank's share. `summed`: the ranks' gradients added, not averaged."""
    import torch

    if "TORCHELASTIC_RUN_ID" in os.environ:  # inside a rank: recording these weights would skip the exercise
        raise RuntimeError("exercise_reference is the checker's answer, computed in the notebook: the exercise's "
                           "script must train the model itself")
    model = _plain_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE * (len(secrets) if summed else 1))
    for step in range(STEPS):
        shares = [exercise_batch(step, secret) for secret in secrets]
        inputs, targets = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def accepted_buckets(cap_bytes: int = BUCKET_CAP_BYTES) -> dict[str, list[int]]:
    """The gradients' element count in each bucket, parameters in reverse order, under the two readings of
    "buckets up to a cap": torch DDP's (a bucket closes once it holds at least the cap: reducer.cpp's
    compute_bucket_assignment_by_size) and "never over the cap" (a parameter larger than the cap alone)."""
    sizes = [(p.numel(), p.numel() * p.element_size()) for p in reversed(list(_plain_model().parameters()))]
    at_least, never_over = [], []
    count = size = 0
    for numel, nbytes in sizes:  # DDP's rule
        count, size = count + numel, size + nbytes
        if size >= cap_bytes:
            at_least.append(count)
            count = size = 0
    at_least += [count] if count else []
    count = size = 0
    for numel, nbytes in sizes:
        if count and size + nbytes > cap_bytes:
            never_over.append(count)
            count = size = 0
        count, size = count + numel, size + nbytes
    never_over.append(count)
    return {"closed once at least the cap (torch DDP's rule)": at_least, "never over the cap": never_over}


def gradient_all_reduces(collectives) -> list[dict]:
    """The all-reduces that carried gradients (more than one value: a logged loss is not one), in order."""
    return [c for c in collectives if c["op"] in ALL_REDUCE_OPS and sum(math.prod(s) for s in c["shapes"]) > 1]


def _values(call: dict) -> int:
    return sum(math.prod(shape) for shape in call["shapes"])


def wrapped_torch_ddp(collectives) -> bool:
    """Whether a rank's collectives show torch DDP's wrap: its check of the parameters across the ranks
    (`_verify_param_shape_across_processes`: an all_gather of one int64, then a broadcast of int64 metadata)."""
    ops = [(c["op"], c["shapes"], c["dtypes"]) for c in collectives]
    return any(op == "all_gather" and shapes == [[1]] and dtypes[:1] in (["long"], ["int64"])
               and ops[i + 1][0] == "broadcast" and ops[i + 1][2][:1] in (["long"], ["int64"])
               for i, (op, shapes, dtypes) in enumerate(ops[:-1]))


def check_my_ddp_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's MyDDP, or confirm it (see the module docstring)."""
    report = ExerciseReport(verdict_when_passed="All checks pass: your MyDDP trains as DDP does, in buckets of the "
                                                "cap, overlapped with the backward.")
    if not run.ok:
        report.mistakes.append("the run failed; fix the error shown above first")
        return report
    if len(run.ranks) < 2:
        report.mistakes.append("run it on 2 or more ranks: with one there is nothing to average")
        return report
    if any("weights" not in r.facts or BACKWARD_FACT not in r.facts for r in run.ranks):
        report.mistakes.append("keep the model from exercise_model(), the training loop and the record(\"weights\", "
                               "...) line: the checker reads every rank's weights and when each backward ran")
        return report
    secrets = rank_secrets(run, report)
    if secrets is None:
        return report
    if any(wrapped_torch_ddp(r.collectives) for r in run.ranks):
        report.mistakes.append("the run wrapped the model in torch's DistributedDataParallel (the flight recorder "
                               "shows its check of the parameters at the wrap): the exercise is to do its work "
                               "in MyDDP yourself")
        return report
    around = side_channels(run)
    if around:
        report.mistakes.append(around)
        return report
    if not any(gradient_all_reduces(r.collectives) for r in run.ranks):
        report.mistakes.append("no rank all-reduced a gradient: each rank stepped with its own batch's gradient alone, "
                               "and the ranks drifted apart")
        return report
    _judge_weights(run, report, secrets)
    if _judge_buckets(run, report):
        _judge_overlap(run, report)
    return report


def _distance(a, b) -> float:
    return math.sqrt(sum(float((x - y).square().sum()) for x, y in zip(a, b)))


def _judge_weights(run: RunResult, report: ExerciseReport, secrets: list[int]) -> None:
    import torch

    weights = [[w.cpu().float() for w in r.facts["weights"]] for r in run.ranks]
    if any(len(w) != len(weights[0]) or any(not torch.equal(a, b) for a, b in zip(w, weights[0])) for w in weights):
        report.mistakes.append("the ranks ended with different weights: every rank must step with the same averaged "
                               "gradients. Was each all-reduce's result used only after it had finished, and did "
                               "every gradient get its bucket's result?")
        return
    reference = exercise_reference(secrets)
    if [w.shape for w in weights[0]] != [r.shape for r in reference]:
        report.mistakes.append("the recorded weights are not the exercise model's: keep its model and record line")
        return
    moved = _distance(reference, [p.detach() for p in _plain_model().parameters()])
    off = _distance(weights[0], reference)
    if off <= WEIGHT_TOLERANCE * moved:
        report.confirmed.append(f"every rank ended with bitwise the same weights, those of one process training on "
                                f"every rank's data, to {off / moved:.0e} of how far training moved them (float32's "
                                "summation order)")
    elif _distance(weights[0], exercise_reference(secrets, summed=True)) <= WEIGHT_TOLERANCE * moved:
        report.mistakes.append(f"the ranks summed their gradients and did not average them: the weights are those of "
                               f"a {len(run.ranks)} times larger learning rate")
    else:
        report.mistakes.append(f"every rank ended with the same weights, but {off / moved:.0%} of the training's "
                               "distance away from one process training on every rank's data: a gradient was "
                               "stepped with something other than the average over the ranks")


def _judge_buckets(run: RunResult, report: ExerciseReport) -> bool:
    accepted = accepted_buckets()
    parameter_sizes = {p.numel() for p in _plain_model().parameters()}
    for r in run.ranks:
        calls = gradient_all_reduces(r.collectives)
        sizes = [_values(c) for c in calls]
        if not calls or r.collectives[0].get("number", 1) != 1:
            report.mistakes.append(f"rank {r.rank}: torch's flight recorder holds no gradient all-reduce from the run's "
                                   "start (it keeps the last 2000): leave it and its size alone")
            return False
        first = calls[0]
        later = [c for c in r.collectives[r.collectives.index(first):]
                 if c["op"] not in ALL_REDUCE_OPS and "barrier" not in c["op"] and _values(c) > 1]
        if later:
            report.mistakes.append(f"rank {r.rank}: after its first gradient all-reduce it also called {later[0]['op']} "
                                   f"({_values(later[0]):,} values): the gradients' average must come from the "
                                   "buckets' all-reduces alone")
            return False
        for rule, buckets in accepted.items():
            per_step = len(buckets)
            if len(sizes) == STEPS * per_step and all(
                    sorted(sizes[i:i + per_step]) == sorted(buckets) for i in range(0, len(sizes), per_step)):
                break
        else:
            shown = ", ".join(f"{s:,}" for s in sizes[:12]) + (" ..." if len(sizes) > 12 else "")
            one_per_parameter = all(size in parameter_sizes for size in sizes) and len(sizes) > STEPS * max(map(len, accepted.values()))
            hint = ("one per parameter: the cap did not group them" if one_per_parameter else
                    "one of the whole model per step: the cap did not split it" if len(sizes) == STEPS else
                    "not the buckets a cap of {:,} bytes makes".format(BUCKET_CAP_BYTES))
            report.mistakes.append(
                f"rank {r.rank} all-reduced gradients {len(sizes)} times in {STEPS} steps ({shown} values), {hint}. "
                f"Parameters in reverse order into buckets of about {BUCKET_CAP_BYTES:,} bytes make "
                + " or ".join(f"{len(b)} a step ({', '.join(f'{n:,}' for n in b)} values: {rule})" for rule, b in accepted.items()))
            return False
    report.confirmed.append(f"every rank all-reduced its gradients in {len(sizes) // STEPS} buckets a step ({rule}), "
                            f"{len(sizes)} all-reduces in {STEPS} steps, as torch's flight recorder saw them")
    return True


def _judge_overlap(run: RunResult, report: ExerciseReport) -> None:
    before_the_end = []
    for r in run.ranks:
        backwards = r.facts[BACKWARD_FACT]
        created = [c.get("started_ns") for c in gradient_all_reduces(r.collectives)]
        if None in created:
            report.mistakes.append("this torch's flight recorder does not time its entries: the overlap cannot be judged")
            return
        during = [sum(start <= t <= end for t in created) for start, end in backwards]
        if len(backwards) < STEPS or min(during) == 0:
            late = sum(n == 0 for n in during) + max(0, STEPS - len(backwards))
            report.mistakes.append(
                f"rank {r.rank}: in {late} of {STEPS} steps no all-reduce started while the backward was still "
                "computing gradients: every bucket waited for the whole backward, and nothing overlapped")
            return
        before_the_end += during
    per_step = len(gradient_all_reduces(run.ranks[0].collectives)) // STEPS
    report.confirmed.append(f"in every step, on every rank, {min(before_the_end)} to {max(before_the_end)} of the "
                            f"{per_step} buckets' all-reduces started while the backward was still computing gradients")
