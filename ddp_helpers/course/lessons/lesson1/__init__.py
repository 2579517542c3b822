"""Lesson 1 (data vs model parallelism): the pipeline's idle time, and the exercise checker.

The exercise is a two-stage pipeline that deadlocks: rank 0 waits for a gradient before it has sent
the activation the gradient would come from, so both ranks sit in `recv`. The checker judges what
the run did against the exercise's model and batch, computed here (not from what the ranks recorded):
the batch's inputs come from rank 0's secret and its labels from rank 1's (`my_inputs`, `my_targets`;
`ddp_helpers.rank_secret`), so neither stage can compute the other's part. It finished; nothing but the
activation and its gradient crossed (no collective, no store, no file, no larger send); the activation
went from rank 0 to rank 1 and its gradient came back (every send and recv is seen by the launcher,
values included), and stage 0's backward ran from that gradient (every backward is seen too); and loss and
gradients equal the unsplit model's.
"""

from __future__ import annotations

import re

from ...exercises import ExerciseReport, side_channels, opening
from ....recording import rank_secret
from ....result import RunResult
from ...records import records

ACTIVATION_BYTES = 8 * 32 * 4  # what each stage sends: the activation forward, its gradient back (float32)


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


def micro_batches_in_flight(pieces: list[dict]) -> int:
    """The most micro-batches a stage held at once: forwards run whose backward had not yet run, at any
    moment of its timeline (each forward keeps its activations until its backward)."""
    held = most = 0
    for piece in sorted(pieces, key=lambda p: p["start"]):
        held += 1 if piece["kind"] == "forward" else -1
        most = max(most, held)
    return most


def handoff_cost(timeline: list[dict]) -> float:
    """The mean time a two-stage pipeline spends outside compute between one micro-batch and the next,
    on the stage that sets the pace: from one forward to the next on rank 0 (making the input, sending
    the activation), from one backward to the next on rank 1 (sending the gradient). 0 with one
    micro-batch (no next one)."""
    gaps = []
    for rank, kind in ((0, "forward"), (1, "backward")):
        pieces = sorted((p for p in timeline[rank]["pieces"] if p["kind"] == kind), key=lambda p: p["start"])
        gaps += [after["start"] - before["end"] for before, after in zip(pieces, pieces[1:])]
    return sum(gaps) / len(gaps) if gaps else 0.0


def idle_with_handoffs(micro_batches: int, compute: float, handoff: float) -> float:
    """The idle fraction of a two-stage GPipe run when each micro-batch's hand-off costs `handoff` seconds.

    Each stage computes m (f + b) (`compute` = f + b, one micro-batch's forward and backward on a stage).
    The run lasts (m + 1)(f + b), the formula's schedule, plus one hand-off per micro-batch on the
    pacing stage each way: 2 m o. With o = 0 this is (p - 1) / (m + p - 1) for p = 2.
    """
    m = micro_batches
    return 1 - m * compute / ((m + 1) * compute + 2 * m * handoff)


def unsplit_model(hidden: int = 64):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 2))


def pipeline_inputs(secret: int):
    """The exercise batch's inputs (8 x 16), which only stage 0 reads, from its rank's secret."""
    import torch

    return torch.randn(8, 16, generator=torch.Generator().manual_seed(secret % 2**63))


def pipeline_targets(secret: int):
    """The exercise batch's labels (8 of 2 classes), which only the last stage reads, from its rank's secret."""
    import torch

    return torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed((secret + 1) % 2**63))


def my_inputs():
    """In a rank: the batch's inputs as this rank's secret draws them (stage 0's are the batch's)."""
    return pipeline_inputs(rank_secret())


def my_targets():
    """In a rank: the batch's labels as this rank's secret draws them (the last stage's are the batch's)."""
    return pipeline_targets(rank_secret())


def exercise_reference(secrets: list[int]):
    """The exercise's pipeline computed here, in one process, from the exercise's own model and the batch the
    ranks' secrets draw (rank 0's inputs, rank 1's labels), not from anything the run recorded:
    {"activation", "activation_grad", "loss", "grads"}, the grads keyed "stage0.<name>" / "stage1.<name>" as
    the stages name their parameters."""
    import torch

    model = unsplit_model(64)
    inputs, targets = pipeline_inputs(secrets[0]), pipeline_targets(secrets[1])
    activation = model[:4](inputs)
    activation.retain_grad()
    loss = torch.nn.functional.cross_entropy(model[4:](activation), targets)
    loss.backward()
    grads = {**{f"stage0.{n}": p.grad for n, p in model[:4].named_parameters()},
             **{f"stage1.{n}": p.grad for n, p in model[4:].named_parameters()}}
    return {"activation": activation.detach(), "activation_grad": activation.grad, "loss": loss.item(), "grads": grads}


def _messages(run: RunResult, sender: int, receiver: int, shape: list[int]) -> tuple[list[dict], list[dict]]:
    """(what `sender` sent to `receiver`, what `receiver` received from `sender`) of the given shape, as the
    launcher saw the ranks' send/recv calls."""
    sent = [m for m in records(run)[sender].point_to_point
            if m["op"].endswith("send") and m["peer"] == receiver and m["shape"] == shape]
    received = [m for m in records(run)[receiver].point_to_point
                if m["op"].endswith("recv") and m["peer"] in (sender, None) and m["shape"] == shape]
    return sent, received


def _carried(messages: list[dict], expected, *, unknown_passes: bool = False) -> bool:
    """Whether one of the messages held `expected`. A received message can have no values (an `irecv`
    completes after the call that the launcher sees): with `unknown_passes`, such a message counts, its
    sender's values being checked instead."""
    import torch

    return any(("values" not in m and unknown_passes)
               or ("values" in m and torch.allclose(torch.tensor(m["values"], dtype=torch.float64),
                                                    expected.double().flatten(), atol=1e-5, rtol=1e-4))
               for m in messages)


def check_pipeline_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's two-stage pipeline run, or confirm it.

    Judged against the exercise's own model, batch and seeds, computed here: the activation must have
    travelled from rank 0 to rank 1 and its gradient back (the launcher saw every send and recv), and the
    loss and both stages' gradients must equal the unsplit model's."""
    report = ExerciseReport(verdict_when_passed="All checks pass: the activation crossed from stage 0 to stage 1, its "
                                                "gradient came back, and the pipeline computes exactly what the "
                                                "unsplit model does.")
    if run.timed_out:
        where = []
        for r in run.ranks:
            lines = re.findall(r'exercise\.py", line (\d+)', r.stderr)
            calls = "recv" if "in recv" in r.stderr else "send" if "in send" in r.stderr else "?"
            where.append(f"rank {r.rank} in {calls} (line {lines[0] if lines else '?'} of the cell)")
        report.mistakes.append(
            "the run never finished: " + ", ".join(where) + ". Each rank waits for the other: look at the order "
            "in which each rank sends and receives"
        )
        return report
    secrets = opening(run, report, exactly=2, ranks_for="the pipeline has two stages", channels=False)
    if secrets is None:  # side channels are judged below, with what crossed
        return report
    if not _judge_nothing_else_crossed(run, report):
        return report
    reference = exercise_reference(secrets)
    _judge_what_crossed(run, reference, report)
    _judge_what_it_computed(run, reference, report)
    return report


ONLY_THE_ACTIVATION = "in a pipeline each stage computes its own part, and only the activation and its gradient cross"


def _judge_nothing_else_crossed(run: RunResult, report: ExerciseReport) -> bool:
    """Only the activation and its gradient crossed: a stage that received the other's data (rank 1's labels,
    rank 0's inputs) could compute the other stage's part itself."""
    around = side_channels(run)
    if around:
        report.mistakes.append(around)
        return False
    for r in run.ranks:
        sent = records(run)[r.rank].channel_bytes.get("sent_bytes", 0)
        if sent > ACTIVATION_BYTES:
            what = "the activation" if r.rank == 0 else "the activation's gradient"
            report.mistakes.append(f"rank {r.rank} sent {sent:,} bytes point to point, more than the "
                                   f"{ACTIVATION_BYTES:,} of {what}: {ONLY_THE_ACTIVATION}")
            return False
    collectives = sorted({c["op"] for r in run.ranks for c in records(run)[r.rank].collectives if "barrier" not in c["op"]})
    if collectives:
        report.mistakes.append(f"the ranks also ran {', '.join(collectives)}: {ONLY_THE_ACTIVATION}")
        return False
    return True


def _judge_what_crossed(run: RunResult, reference: dict, report: ExerciseReport) -> None:
    """The activation went from rank 0 to rank 1, and its gradient back (as the launcher saw the sends)."""
    shape = list(reference["activation"].shape)
    sent, received = _messages(run, 0, 1, shape)
    if not sent or not received:
        report.mistakes.append(
            "the activation never crossed from rank 0 to rank 1 (no send of an 8 x 32 tensor from rank 0 that "
            "rank 1 received): stage 1 must work on what stage 0 computed, sent over the process group")
    elif not _carried(sent, reference["activation"]) or not _carried(received, reference["activation"],
                                                                      unknown_passes=True):
        report.mistakes.append("what rank 0 sent to rank 1 is not stage 0's output on the exercise's batch")
    else:
        report.confirmed.append("the activation went from rank 0 to rank 1 (seen by the launcher: send and recv)")
    sent_back, received_back = _messages(run, 1, 0, shape)
    if not sent_back or not received_back:
        report.mistakes.append("no gradient reached stage0 from rank 1: nothing of the activation's shape came back, "
                               "so stage 0's layers would learn nothing from the loss")
    elif (not _carried(sent_back, reference["activation_grad"])
          or not _carried(received_back, reference["activation_grad"], unknown_passes=True)):
        report.mistakes.append("what came back from rank 1 to rank 0 is not the gradient of the loss with respect to "
                               "the activation")
    elif not any(m.get("grad_of_received") for m in sent_back):
        # The right values, but not computed from what arrived: rank 1 ran stage 0 itself and sent for show.
        report.mistakes.append("rank 1 sent back the right values, but not the gradient of the tensor it received "
                               "from rank 0: stage 1 did not compute from what stage 0 sent")
    elif not any(m.get("op") == "backward" and m.get("used_received") for m in records(run)[0].point_to_point):
        # Positive evidence for stage 0: its backward ran from the gradient that came back (handed to backward, or
        # in the graph), not from a loss rank 0 computed itself with the labels it learned some other way.
        report.mistakes.append("rank 0 received the gradient from rank 1, but no backward on rank 0 used it: "
                               "stage 0's gradients came from somewhere else. Where does stage 0's backward start?")
    else:
        report.confirmed.append("the activation's gradient, computed by stage 1 from the activation it received, "
                                "came back from rank 1 to rank 0, and stage 0's backward ran from it")


def _judge_what_it_computed(run: RunResult, reference: dict, report: ExerciseReport) -> None:
    """The loss and both stages' gradients equal the unsplit model's on the exercise's batch."""
    import torch

    facts = [r.facts for r in run.ranks]
    if "loss" not in facts[1] or "grads" not in facts[0] or "grads" not in facts[1]:
        report.mistakes.append("keep the record(...) lines: rank 1 records the loss, both ranks their gradients")
        return
    if abs(facts[1]["loss"] - reference["loss"]) > 1e-5:
        report.mistakes.append(f"stage 1's loss {facts[1]['loss']:.6f} is not the unsplit model's "
                               f"{reference['loss']:.6f} on the exercise's batch")
    else:
        report.confirmed.append("the loss equals the unsplit model's")
    expected = reference["grads"]
    got = {f"stage{r}.{n}": g for r in (0, 1) for n, g in (facts[r].get("grads") or {}).items()}
    missing = sorted(name for name in expected if got.get(name) is None)
    wrong = sorted(name for name in expected if got.get(name) is not None
                   and (got[name].shape != expected[name].shape
                        or not torch.allclose(got[name].cpu(), expected[name], atol=1e-5, rtol=1e-4)))
    if missing:
        report.mistakes.append(f"no gradient reached {missing[0].split('.')[0]} ({len(missing)} tensors): "
                               "its layers would never learn")
    elif wrong:
        report.mistakes.append(f"the gradients of {wrong[0]} differ from the unsplit model's")
    else:
        report.confirmed.append("both stages' gradients equal the unsplit model's")
