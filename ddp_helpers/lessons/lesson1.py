"""Lesson 1 (data vs model parallelism): the pipeline's idle time, and the exercise checker.

The exercise is a two-stage pipeline that deadlocks: rank 0 waits for a gradient before it has sent
the activation the gradient would come from, so both ranks sit in `recv`. The checker judges what
the run did: it finished; stage 1 computed the loss; both stages got gradients; and loss and
gradients equal the unsplit model's on the same batch (computed here from what the ranks recorded).
"""

from __future__ import annotations

import re

from ..exercises import ExerciseReport
from ..result import RunResult


def idle_fractions(timeline: list[dict]) -> list[float]:
    """Per rank, the share of the run's wall time in which it computed nothing.

    Args:
        timeline: per rank {"pieces": [{"start", "end", ...}], "total": seconds}, times from a common start.
    """
    span = max(rank["total"] for rank in timeline)
    return [1 - sum(p["end"] - p["start"] for p in rank["pieces"]) / span for rank in timeline]


def bubble_formula(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def unsplit_model(hidden: int = 64):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 2))


def check_pipeline_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's two-stage pipeline run, or confirm it."""
    import torch

    report = ExerciseReport(verdict_when_passed="All checks pass: the pipeline computes exactly what the unsplit model does.")
    if run.timed_out:
        where = []
        for r in run.ranks:
            lines = re.findall(r'exercise\.py", line (\d+)', r.stderr)
            calls = "recv" if "in recv" in r.stderr else "send" if "in send" in r.stderr else "?"
            where.append(f"rank {r.rank} in {calls} (line {lines[0] if lines else '?'})")
        report.mistakes.append(
            "the run never finished: " + ", ".join(where) + ". Each rank waits for the other: look at the order "
            "in which each rank sends and receives"
        )
        return report
    if not run.ok:
        report.mistakes.append("the run failed; fix the error shown above first")
        return report
    facts = [r.facts for r in run.ranks]
    if len(facts) != 2 or "loss" not in facts[1] or "batch" not in facts[0]:
        report.mistakes.append("keep the record(...) lines: rank 1 records the loss, rank 0 the batch")
        return report
    model = unsplit_model()
    model.load_state_dict(facts[0]["start_weights"])
    inputs, targets = facts[0]["batch"]
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    if abs(facts[1]["loss"] - loss.item()) > 1e-5:
        report.mistakes.append(f"stage 1's loss {facts[1]['loss']:.6f} is not the unsplit model's {loss.item():.6f}: "
                               "the activation stage 1 worked on is not stage 0's")
    else:
        report.confirmed.append("the loss equals the unsplit model's")
    expected = {**{f"stage0.{n}": p.grad for n, p in model[:4].named_parameters()},
                **{f"stage1.{n}": p.grad for n, p in model[4:].named_parameters()}}
    got = {f"stage{r}.{n}": g for r in (0, 1) for n, g in (facts[r].get("grads") or {}).items()}
    missing = sorted(name for name in expected if got.get(name) is None)
    wrong = sorted(name for name in expected if got.get(name) is not None
                   and not torch.allclose(got[name].cpu(), expected[name], atol=1e-5, rtol=1e-4))
    if missing:
        report.mistakes.append(f"no gradient reached {missing[0].split('.')[0]} ({len(missing)} tensors): "
                               "its layers would never learn")
    elif wrong:
        report.mistakes.append(f"the gradients of {wrong[0]} differ from the unsplit model's")
    else:
        report.confirmed.append("both stages' gradients equal the unsplit model's")
    return report
