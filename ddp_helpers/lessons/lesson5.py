"""Lesson 5 (when things go wrong): the exercise's reference training and its checker.

The exercise trains a small linear model by hand-written data parallelism. Each rank reads its own
shard and drops samples with an outlier; a rank whose whole batch is dropped skips the step, its
all-reduces included, so from then on its collectives pair with the other ranks' collectives of the
step before, and the run ends stuck (a rank at the final barrier while another still trains). The fix:
a rank with nothing to learn from still takes part, with a zero gradient.

The checker computes the intended training itself, in one process, from the exercise's model, data
and seeds (`exercise_reference`), and judges the learner's run against it: it finished; every rank
took part in every step; the ranks' weights agree bitwise; and they are the reference's.
"""

from __future__ import annotations

from ..exercises import ExerciseReport
from ..result import RunResult

STEPS = 20
BATCH = 3  # per rank and step: small enough that, now and then, all of a rank's batch is dropped
OUTLIER = 1.5  # a sample with any feature beyond this is dropped
LEARNING_RATE = 0.1


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
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    streams = [rank_batches(rank) for rank in range(world_size)]
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for stream in streams:
            inputs, targets, keep = next(stream)
            if keep.any():
                model.zero_grad()
                torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep]).backward()
                for sum_, p in zip(total, model.parameters()):
                    sum_ += p.grad
        for sum_, p in zip(total, model.parameters()):
            p.grad = sum_ / world_size
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


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
        cause = run.hang.cause if run.hang else "see where each rank was, above"
        report.mistakes.append(
            f"the run still hangs. {cause} Which step did each rank reach last (their 'step N done' lines), and why "
            "would one rank run fewer all-reduces than another? A longer timeout or an added barrier does not "
            "change that")
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
    agree = all(all(torch.equal(a, b) for a, b in zip(weights[0], other)) for other in weights[1:])
    if not agree:
        report.mistakes.append("the ranks' weights differ: each step's gradients must be all-reduced on every rank, "
                               "every step")
        return report
    report.confirmed.append(f"the {world_size} ranks' weights agree bitwise")
    reference = exercise_reference(world_size)
    if all(torch.allclose(mine, ref, atol=1e-6) for mine, ref in zip(weights[0], reference)):
        report.confirmed.append("the weights are those of the intended training, computed here in one process")
    else:
        report.mistakes.append(
            "the weights are not those of the intended training: each rank's gradient of its kept samples (zero "
            "when it kept none), summed over the ranks and divided by the world size; samples with an outlier "
            "stay dropped")
    return report
