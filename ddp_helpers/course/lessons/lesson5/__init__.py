"""Lesson 5 (when things go wrong): the exercise's reference training and its checker.

The exercise trains a small linear model by hand-written data parallelism. Each rank reads its own
shard and drops samples with an outlier; a rank whose whole batch is dropped skips the step, its
all-reduces included, so from then on its collectives pair with the other ranks' collectives of the
step before, and the run ends stuck (a rank at the final barrier while another still trains). The fix:
a rank with nothing to learn from still takes part, with a zero gradient.

Each rank's shard is drawn from its secret (`ddp_helpers.rank_secret`: only that rank's process is handed
it, anew for each run), so no rank can compute another's gradient. The checker reads every rank's secret
from the run folder, computes the intended training itself, in one process (`exercise_reference`), and
judges the learner's run against it, naming the first mistake only: it finished; every rank took part in
every step; torch's flight recorder saw every rank all-reduce a gradient's worth each step (DDP's bucket
all-reduces count too); the ranks' weights agree bitwise; they are the reference's; and, the positive evidence,
each rank's all-reduces carried its own gradient every step (what it handed `dist.all_reduce`, or what its DDP
model handed DDP's buckets), so that ranks learning each other's data by any other road are judged wrong.

Also here: `py_spy_dump`, deep dive 5b's look at a live job from outside.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ...exercises import ExerciseReport, all_reduced_values, own_gradients_unseen, opening
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

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


def torchrun_failures(output: str) -> tuple[int | None, dict[int, str]]:
    """From plain torchrun's failure summary (`ChildFailedError`): the rank it names as the root cause, and each
    failed rank's time as torchrun printed it (an `@record` error file's whole-second timestamp)."""
    failures = {}
    for when, rank in re.findall(r"^\s+time\s+: (\S+)\n\s+host\s+: .*\n\s+rank\s+: (\d+)", output, flags=re.M):
        failures[int(rank)] = when
    root = re.search(r"Root Cause \(first observed failure\):\n\[\d+\]:\n\s+time\s+: \S+\n\s+host\s+: .*\n"
                     r"\s+rank\s+: (\d+)", output)
    return (int(root.group(1)) if root else None), failures


def shard(secret: int, last_rank: bool):
    """A rank's shard for the exercise, drawn from its secret: per step, (inputs, targets). Only the last rank
    ever has a batch whose samples all have an outlier (at least once, at a step drawn from its secret), so
    that the given script's ranks always fall out of step, and every run differently."""
    import torch

    generator = torch.Generator().manual_seed(secret)
    true_weight = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    emptied = 2 + secret % (STEPS - 6)  # leaves the steps after it for the ranks to fall out of step
    for step in range(STEPS):
        inputs = torch.randn(BATCH, 4, generator=generator)
        if last_rank and step == emptied:
            inputs[:, 0] = 2 * OUTLIER  # every sample has an outlier
        elif not last_rank and not (inputs.abs().max(dim=1).values < OUTLIER).any():
            inputs[0] = inputs[0].clamp(-OUTLIER / 2, OUTLIER / 2)  # one sample kept
        yield inputs, inputs @ true_weight.T


def my_shard():
    """In a rank: this rank's own shard (`shard`), from the secret only this rank's process is handed. From here on
    the launcher also logs what a DDP model hands its all-reduces (`_all_reduce_log.log_ddp_gradients`), the
    evidence the checker asks for when the fix goes through DDP."""
    import os

    from ... import _all_reduce_log

    _all_reduce_log.log_ddp_gradients()
    return shard(rank_secret(), int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1)


def _kept(inputs):
    return inputs.abs().max(dim=1).values < OUTLIER


def exercise_reference(secrets: list[int]) -> list:
    """The weight and bias after the intended training on ranks with these secrets: each rank's gradient of
    its kept samples' mean loss (zero when it kept none), summed over the ranks and divided by the world size."""
    return _intended_training(secrets)[0]


def _intended_training(secrets: list[int]) -> tuple[list, list]:
    """(the weights `exercise_reference` gives, and per step, per rank, the rank's own gradient [weight, bias]
    of its kept samples on the way: zeros when it kept none)."""
    import os

    import torch  # noqa: F401

    if "TORCHELASTIC_RUN_ID" in os.environ:  # inside a rank: recording these weights would skip the exercise
        raise RuntimeError("exercise_reference is the checker's answer, computed in the notebook: the exercise's "
                           "script must train the model itself")
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    streams = [shard(secret, rank == len(secrets) - 1) for rank, secret in enumerate(secrets)]
    own_gradients = []
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        own_gradients.append([])
        for stream in streams:
            inputs, targets = next(stream)
            keep = _kept(inputs)
            own = [torch.zeros_like(p) for p in model.parameters()]
            if keep.any():
                model.zero_grad()
                torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep]).backward()
                own = [p.grad.detach().clone() for p in model.parameters()]
            own_gradients[-1].append(own)
            for sum_, gradient in zip(total, own):
                sum_ += gradient
        for sum_, p in zip(total, model.parameters()):
            p.grad = sum_ / len(secrets)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], own_gradients


def skipped_steps(secrets: list[int]) -> dict[int, list[int]]:
    """Per rank, the steps at which its shard leaves it no sample (where the given script skips)."""
    return {rank: [step for step, (inputs, _) in enumerate(shard(secret, rank == len(secrets) - 1))
                   if not _kept(inputs).any()]
            for rank, secret in enumerate(secrets)}


@records_progress  # the learner's progress notes whether this run passed
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
    secrets = opening(run, report, ranks_for="the hang needs a rank whose batch is all dropped while another's is not",
                      facts=("steps", "weights"))
    if secrets is None:
        return report
    steps, weights = run.facts("steps"), run.facts("weights")
    _judge_the_training(run, report, steps, weights, secrets)
    return report


def _judge_the_training(run: RunResult, report: ExerciseReport, steps: list, weights: list, secrets: list[int]) -> None:
    """The first mistake, and only it (what follows from it, other weights say, is not a second mistake): every
    rank in every step, a gradient's worth all-reduced each step, the ranks agreeing, the intended training."""
    import torch

    world_size = len(run.ranks)
    incomplete = {rank: sorted(set(range(STEPS)) - set(done)) for rank, done in enumerate(steps) if done != list(range(STEPS))}
    if incomplete:
        report.mistakes.append(
            "not every rank took part in every step (" + "; ".join(f"rank {r} missed steps {s}" for r, s in incomplete.items())
            + "): a rank with no sample left still takes part, with a zero gradient, so that the ranks' all-reduces "
              "stay in step; skipping the step on every rank changes the training")
        return
    report.confirmed.append(f"every rank took part in all {STEPS} steps")
    gradient_values = {rank.rank: all_reduced_values(records(run)[rank.rank].collectives, ("all_reduce", "allreduce")) for rank in run.ranks}
    expected = STEPS * PARAMETERS
    short = {rank: values for rank, values in gradient_values.items() if values < expected}
    if short:
        report.mistakes.append(
            "torch's flight recorder saw too few all-reduces for a gradient of " f"{PARAMETERS} values in each of "
            f"{STEPS} steps ({expected} values) on " + "; ".join(f"rank {r}: {v}" for r, v in short.items())
            + ": every rank all-reduces its gradient every step")
        return
    report.confirmed.append(f"torch's flight recorder saw every rank all-reduce at least a gradient's {PARAMETERS} "
                            f"values in each of the {STEPS} steps")
    agree = all(all(torch.equal(a, b) for a, b in zip(weights[0], other)) for other in weights[1:])
    if not agree:
        report.mistakes.append("the ranks' weights differ: each step's gradients must be all-reduced on every rank, "
                               "every step")
        return
    report.confirmed.append(f"the {world_size} ranks' weights agree bitwise")
    reference, own_gradients = _intended_training(secrets)
    if [tuple(w.shape) for w in weights[0]] != [tuple(r.shape) for r in reference]:
        report.mistakes.append("record('weights', ...) as given: the model's weight and bias, "
                               f"{[list(r.shape) for r in reference]}")
    elif all(torch.allclose(mine, ref, atol=1e-6) for mine, ref in zip(weights[0], reference)):
        report.confirmed.append("the weights are those of the intended training on the ranks' own shards, computed "
                                "here in one process from every rank's secret")
        unseen = own_gradients_unseen(run, own_gradients)
        if unseen:
            report.mistakes.append(
                "the weights are right, but no all-reduce the launcher saw carried "
                + "; ".join(f"rank {r}'s own gradient at step {steps[0]}" + (f" (and {len(steps) - 1} more steps)"
                                                                              if len(steps) > 1 else "")
                            for r, steps in unseen.items())
                + ": the other ranks' data reached each rank some other way. What does each rank put into its "
                  "all-reduces?")
        else:
            report.confirmed.append("every rank's all-reduces carried its own gradient, every step")
    else:
        report.mistakes.append(
            "the weights are not those of the intended training: each rank's gradient of its kept samples (zero "
            "when it kept none), summed over the ranks and divided by the world size; samples with an outlier "
            "stay dropped")
