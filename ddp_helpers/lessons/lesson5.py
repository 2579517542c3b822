"""Lesson 5 (when things go wrong): the exercise's reference training and its checker.

The exercise trains a small linear model by hand-written data parallelism. Each rank reads its own
shard and drops samples with an outlier; a rank whose whole batch is dropped skips the step, its
all-reduces included, so from then on its collectives pair with the other ranks' collectives of the
step before, and the run ends stuck (a rank at the final barrier while another still trains). The fix:
a rank with nothing to learn from still takes part, with a zero gradient.

The checker computes the intended training itself, in one process, from the exercise's model, data
and seeds (`exercise_reference`), and judges the learner's run against it: it finished; every rank
took part in every step; the ranks' weights agree bitwise; and they are the reference's.

Also here: `py_spy_dump`, section 6's look at a live job from outside.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..exercises import ExerciseReport
from ..result import RunResult

STEPS = 20
BATCH = 3  # per rank and step: small enough that, now and then, all of a rank's batch is dropped
OUTLIER = 1.5  # a sample with any feature beyond this is dropped
LEARNING_RATE = 0.1
PARAMETERS = 5  # the model's: a weight of 4 and a bias
_ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
# How py-spy says that ptrace was refused (EPERM, EACCES): trying again cannot help.
_REFUSED = re.compile(r"Operation not permitted|Permission denied|os error (1|13)\)")


def py_spy_dump(pid: int, until: str, timeout_s: float = 20) -> tuple[bool, str]:
    """`py-spy dump --pid PID`, repeated until its output shows `until` (e.g. "train.py:23", the line
    the process is expected to stop at): (whether py-spy could read the process, its last output).
    py-spy reads another process's memory through ptrace; where Linux refuses that (Yama's
    `ptrace_scope` 1 lets a process trace only its own descendants, and py-spy is not the ranks'
    ancestor), it fails at once, and its message says so."""
    # The py-spy installed with the course, beside this Python, whether or not its folder is on PATH.
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    deadline = time.monotonic() + timeout_s
    while True:
        dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
        # Plain text: a kernel's environment asks command-line tools for colours (CLICOLOR_FORCE).
        text = _ANSI_COLOURS.sub("", dump.stdout if dump.returncode == 0 else dump.stderr or dump.stdout).strip()
        message = text.split("Stack backtrace:")[0].strip()  # py-spy's message, without its own stack
        if dump.returncode != 0 and _REFUSED.search(message):
            return False, message
        if (dump.returncode == 0 and until in text) or time.monotonic() > deadline:
            return dump.returncode == 0, text if dump.returncode == 0 else message
        # Not there yet, or a sample taken while the process changed its frames ("Failed to copy
        # PyFrameObject"): py-spy reads a live process, and trying again is what it takes.
        time.sleep(0.2)


def ptrace_scope() -> str | None:
    """Yama's ptrace policy (0: classic; 1: only descendants, Ubuntu's default; 2: admin only; 3: none),
    or None where the kernel has no Yama."""
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return None


def rank_batches(rank: int):
    """The exercise's data for `rank`: per step, (inputs, targets, which samples are kept)."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)  # each rank reads its own shard
    true_weight = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    for _ in range(STEPS):
        inputs = torch.randn(BATCH, 4, generator=generator)
        targets = inputs @ true_weight.T
        yield inputs, targets, inputs.abs().max(dim=1).values < OUTLIER


def exercise_reference(world_size: int) -> list:
    """The weight and bias after the intended training on `world_size` ranks: each rank's gradient of its
    kept samples' mean loss (zero when it kept none), summed over the ranks and divided by the world size."""
    import os

    import torch

    if "TORCHELASTIC_RUN_ID" in os.environ:  # inside a rank: recording these weights would skip the exercise
        raise RuntimeError("exercise_reference is the checker's answer, computed in the notebook: the exercise's "
                           "script must train the model itself")
    return _intended_training(world_size)[0]


def _intended_training(world_size: int) -> tuple[list, dict[int, list]]:
    """(the weight and bias after the intended training, {rank: each step's weight gradient of its own kept
    samples, zero where it kept none}): what each rank must put into its all-reduce, step by step."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    streams = [rank_batches(rank) for rank in range(world_size)]
    contributions = {rank: [] for rank in range(world_size)}
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank, stream in enumerate(streams):
            inputs, targets, keep = next(stream)
            model.zero_grad()
            if keep.any():
                torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep]).backward()
                for sum_, p in zip(total, model.parameters()):
                    sum_ += p.grad
            contributions[rank].append(model.weight.grad.clone() if keep.any() else torch.zeros_like(model.weight))
        for sum_, p in zip(total, model.parameters()):
            p.grad = sum_ / world_size
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], contributions


def skipped_steps(world_size: int) -> dict[int, list[int]]:
    """Per rank, the steps at which the given data leaves it no sample (where the given script skips)."""
    return {rank: [step for step, (_, _, keep) in enumerate(rank_batches(rank)) if not keep.any()]
            for rank in range(world_size)}


def check_hang_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's run of the exercise, or confirm it."""
    import torch

    report = ExerciseReport(verdict_when_passed="All checks pass: every rank took part in every step, the ranks "
                                                "agree bitwise, and the model trained as intended.")
    if run.timed_out:
        cause = run.hang.cause if run.hang else "See where each rank was, above."
        # The given script's hang: a rank one all-reduce behind pairs its collectives with the wrong ones
        # (the hang report's "disagree"), or one rank left while another still waits in a collective.
        if "disagree at collective" in cause or ("never called" in cause and "in your code" not in cause):
            report.mistakes.append(
                f"the run hangs. {cause} Which step did each rank reach last (their 'step N done' lines), and why "
                "would one rank run fewer all-reduces than another? A longer timeout or an added barrier does not "
                "change that")
        else:  # no rank waits on a collective the others will not call: perhaps only a slow start
            report.mistakes.append(
                f"the run did not finish within its --timeout of {run.config.timeout_s:.0f} s, and no rank waited on a "
                f"collective another would not call. {cause} If the ranks were still printing 'step N done' lines, "
                "the machine is only slow: raise --timeout (e.g. --timeout 30) and run it again")
        return report
    if not run.ok:
        report.mistakes.append("the run failed; fix the error shown above first")
        return report
    try:
        steps, weights = run.facts("steps"), run.facts("weights")
    except KeyError:
        report.mistakes.append("keep the record('steps', ...) and record('weights', ...) lines: the checker reads them")
        return report
    world_size = len(run.ranks)
    if world_size < 2 or not any(skipped_steps(world_size).values()):
        report.mistakes.append(f"run it on 2 ranks or more (it ran on {world_size}): the hang needs a rank whose "
                               "batch is all dropped while another's is not")
        return report
    incomplete = {rank: sorted(set(range(STEPS)) - set(done)) for rank, done in enumerate(steps) if done != list(range(STEPS))}
    if incomplete:
        report.mistakes.append(
            "not every rank took part in every step (" + "; ".join(f"rank {r} missed steps {s}" for r, s in incomplete.items())
            + "): a rank with no sample left still takes part, with a zero gradient, so that the ranks' all-reduces "
              "stay in step; skipping the step on every rank changes the training")
    else:
        report.confirmed.append(f"every rank took part in all {STEPS} steps")
    gradient_values = {rank.rank: _all_reduced_values(rank.collectives) for rank in run.ranks}
    expected = STEPS * PARAMETERS
    short = {rank: values for rank, values in gradient_values.items() if values < expected}
    if short:
        report.mistakes.append(
            "torch's flight recorder saw too few all-reduces for a gradient of " f"{PARAMETERS} values in each of "
            f"{STEPS} steps ({expected} values) on " + "; ".join(f"rank {r}: {v}" for r, v in short.items())
            + ": every rank all-reduces its gradient every step")
        return report
    report.confirmed.append(f"torch's flight recorder saw every rank all-reduce at least a gradient's {PARAMETERS} "
                            f"values in each of the {STEPS} steps")
    agree = all(all(torch.equal(a, b) for a, b in zip(weights[0], other)) for other in weights[1:])
    if not agree:
        report.mistakes.append("the ranks' weights differ: each step's gradients must be all-reduced on every rank, "
                               "every step")
        return report
    report.confirmed.append(f"the {world_size} ranks' weights agree bitwise")
    _judge_against_the_intended_training(report, run, weights[0])
    return report


def _judge_against_the_intended_training(report: ExerciseReport, run: RunResult, weights: list) -> None:
    """The weights against the intended training's, and what each rank put into its all-reduces against
    its own gradient of each step."""
    import torch

    world_size = len(run.ranks)
    reference, contributions = _intended_training(world_size)
    if [tuple(w.shape) for w in weights] != [tuple(r.shape) for r in reference]:
        report.mistakes.append("record('weights', ...) as given: the model's weight and bias, "
                               f"{[list(r.shape) for r in reference]}")
    elif all(torch.allclose(mine, ref, atol=1e-6) for mine, ref in zip(weights, reference)):
        report.confirmed.append("the weights are those of the intended training, computed here in one process")
    else:
        report.mistakes.append(
            "the weights are not those of the intended training: each rank's gradient of its kept samples (zero "
            "when it kept none), summed over the ranks and divided by the world size; samples with an outlier "
            "stay dropped")
    not_contributed = {rank.rank: missing for rank in run.ranks
                       if (missing := _steps_not_contributed(rank.all_reduced, contributions[rank.rank], world_size))}
    if not_contributed:
        report.mistakes.append(
            "not every rank all-reduced its own gradient ("
            + "; ".join(f"rank {r}: steps {s}" for r, s in not_contributed.items())
            + "): each rank puts in the gradient of its own kept samples, or zeros where it kept none, and the "
              "all-reduce sums them; a rank must not compute the other ranks' gradients, nor all-reduce something else")
    else:
        report.confirmed.append("every rank all-reduced its own gradient in every step (zeros where it kept no "
                                "sample), as the launcher saw the values it put in")


def _steps_not_contributed(all_reduced, expected: list, world_size: int) -> list[int]:
    """The steps whose weight gradient (expected[step], or it divided by the world size) is in none of the
    values the rank handed to all_reduce, in order: the all-reduces of one step come after the previous's."""
    import torch

    inputs = [torch.tensor(call["values"], dtype=torch.float64) for call in all_reduced if "values" in call]
    missing, position = [], 0
    for step, gradient in enumerate(expected):
        wanted = [gradient.double().flatten(), gradient.double().flatten() / world_size]
        found = next((index for index in range(position, len(inputs))
                      if any(_contains(inputs[index], w) for w in wanted)), None)
        if found is None:
            missing.append(step)
        else:
            position = found + 1
    return missing


def _contains(values, wanted) -> bool:
    """Whether `wanted` appears, to float32's rounding, as consecutive elements of `values`."""
    import torch

    n = len(wanted)
    return any(torch.allclose(values[start:start + n], wanted, rtol=1e-4, atol=1e-6)
               for start in range(len(values) - n + 1))


def _all_reduced_values(collectives) -> int:
    """How many values a rank all-reduced (the elements of every all_reduce's tensors), from what the
    flight recorder saw: a count the script cannot fake by what it records about itself."""
    from math import prod

    return sum(prod(shape) for call in collectives if call["op"] in ("all_reduce", "allreduce")
               for shape in call["shapes"])
