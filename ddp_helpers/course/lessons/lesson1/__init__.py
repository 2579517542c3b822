"""Lesson 1 (data vs model parallelism): the pipeline's idle time, and the exercise checker.

The exercise gives the two-stage pipeline with its batch cut into 4 micro-batches, run as GPipe (every forward,
then every backward): stage 0 holds all four micro-batches' activations. The learner rewrites it as 1F1B. The
checker judges what the run did against the exercise's model and batch, computed here (not from what the ranks
recorded): the batch's inputs come from rank 0's secret and its labels from rank 1's (`my_inputs`, `my_targets`;
`ddp_helpers.rank_secret`), so neither stage can compute the other's part. It finished; nothing but the
activations and their gradients crossed (no collective, no store, no file, no larger send); every micro-batch's
activation went from rank 0 to rank 1 and its gradient came back (every send and recv is seen by the launcher,
values included), and stage 0's backwards ran from those gradients (every backward is seen too); stage 0 never
held more than two micro-batches' activations, and had run the next micro-batch's forward whenever it called for
a gradient (autograd's saved tensors, measured in the rank: `_held_activations`); the order of the calls would
also finish on GPUs (`nccl_order`); and loss and gradients equal the unsplit model's.
"""

from __future__ import annotations


from ... import _held_activations
from ...exercises import ExerciseReport, side_channels, opening
from ...nccl_order import stuck_on_nccl
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

MICRO_BATCHES, MICRO_BATCH = 4, 8  # the exercise's batch of 32, cut into 4 micro-batches of 8
ACTIVATION_BYTES = MICRO_BATCH * 32 * 4  # one micro-batch's activation at the cut (float32); its gradient the same
IN_FLIGHT = 2  # 1F1B on 2 stages: stage 0 holds at most p - 0 = 2 micro-batches' activations


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
    """The exercise batch's inputs (32 x 16), which only stage 0 reads, from its rank's secret."""
    import torch

    return torch.randn(MICRO_BATCHES * MICRO_BATCH, 16, generator=torch.Generator().manual_seed(secret % 2**63))


def pipeline_targets(secret: int):
    """The exercise batch's labels (32 of 2 classes), which only the last stage reads, from its rank's secret."""
    import torch

    return torch.randint(0, 2, (MICRO_BATCHES * MICRO_BATCH,),
                         generator=torch.Generator().manual_seed((secret + 1) % 2**63))


def my_inputs():
    """In a rank: the batch's inputs as this rank's secret draws them (stage 0's are the batch's). From here on, the
    rank measures what autograd holds for backward (the checker's evidence of the schedule)."""
    _held_activations.watch()
    return pipeline_inputs(rank_secret())


def my_targets():
    """In a rank: the batch's labels as this rank's secret draws them (the last stage's are the batch's)."""
    _held_activations.watch()
    return pipeline_targets(rank_secret())


def exercise_reference(secrets: list[int]):
    """The exercise's pipeline computed here, in one process, from the exercise's own model and the batch the
    ranks' secrets draw (rank 0's inputs, rank 1's labels), not from anything the run recorded: {"activations",
    "activation_grads" (one per micro-batch, the loss being the whole batch's mean), "loss", "grads"}, the grads
    keyed "stage0.<name>" / "stage1.<name>" as the stages name their parameters."""
    import torch

    model = unsplit_model(64)
    inputs, targets = pipeline_inputs(secrets[0]), pipeline_targets(secrets[1])
    activations = [model[:4](micro) for micro in inputs.chunk(MICRO_BATCHES)]
    for activation in activations:
        activation.retain_grad()
    losses = [torch.nn.functional.cross_entropy(model[4:](a), t) / MICRO_BATCHES
              for a, t in zip(activations, targets.chunk(MICRO_BATCHES))]
    sum(losses).backward()
    grads = {**{f"stage0.{n}": p.grad for n, p in model[:4].named_parameters()},
             **{f"stage1.{n}": p.grad for n, p in model[4:].named_parameters()}}
    return {"activations": [a.detach() for a in activations], "activation_grads": [a.grad for a in activations],
            "loss": sum(loss.item() for loss in losses), "grads": grads}


def one_micro_batch_held(stage: int) -> int:
    """The bytes autograd holds for backward after one micro-batch's forward on `stage` (the last stage's with its
    loss), measured here as the rank measures them (`_held_activations`): the unit the checker counts in."""
    import torch

    model = unsplit_model(64)
    counter = _held_activations.HeldForBackward()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        if stage == 0:
            output = model[:4](torch.zeros(MICRO_BATCH, 16))
        else:
            received = torch.zeros(MICRO_BATCH, 32, requires_grad=True)
            output = torch.nn.functional.cross_entropy(model[4:](received), torch.zeros(MICRO_BATCH, dtype=torch.long))
    del output
    return counter.peak


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


def _all_carried(messages: list[dict], expected: list, **kwargs) -> int | None:
    """The first micro-batch whose tensor none of the messages held, or None if each one's was."""
    return next((k for k, tensor in enumerate(expected) if not _carried(messages, tensor, **kwargs)), None)


def _first_not_crossed(sent: list[dict], received: list[dict], expected: list) -> int | None:
    """The first micro-batch whose tensor was not both sent and received (a receive without values, an irecv's,
    counts: its sender's values are checked), or None."""
    missing = _all_carried(sent, expected)
    return missing if missing is not None else _all_carried(received, expected, unknown_passes=True)


@records_progress  # the learner's progress notes whether this run passed
def check_pipeline_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's 1F1B pipeline run, or confirm it.

    Judged against the exercise's own model, batch and seeds, computed here: every micro-batch's activation must
    have travelled from rank 0 to rank 1 and its gradient back (the launcher saw every send and recv); stage 0 held
    at most two micro-batches' activations, and the next one's whenever it called for a gradient (measured in the
    rank); the calls' order must also finish on nccl; and the loss and both stages' gradients must equal the
    unsplit model's."""
    report = ExerciseReport(verdict_when_passed="All checks pass: every micro-batch's activation crossed from stage "
                                                "0 to stage 1 and its gradient came back, stage 0 never held more than "
                                                "two micro-batches and kept stage 1 fed, the order would run on GPUs "
                                                "too, and the pipeline computes exactly what the unsplit model does.")
    if run.timed_out:
        # The hang report says what each rank waits in ("recv from rank 1", "irecv from rank 1": its wait()).
        states = {state.rank: state for state in (run.hang.ranks if run.hang else ())}
        where, calls = [], set()
        for r in run.ranks:
            state = states.get(r.rank)
            waiting = state.waiting_in if state and state.waiting_in else "?"
            line = state.line.replace("line ", "") if state and state.line else "?"
            calls.add(waiting.split(" ")[0])
            where.append(f"rank {r.rank} in {waiting} (line {line} of the cell)")
        why = (" A send here returns only once the other rank has received it (on GPUs, nccl's returns at once but "
               "the GPU waits the same way), so two ranks that both send first wait for each other."
               if calls == {"send"} else "")
        report.mistakes.append(
            "the run never finished: " + ", ".join(where) + ". Each rank waits for the other: look at the order "
            "in which each rank sends and receives, side by side." + why
        )
        return report
    secrets = opening(run, report, exactly=2, ranks_for="the pipeline has two stages", channels=False)
    if secrets is None:  # side channels are judged below, with what crossed
        return report
    if not _judge_nothing_else_crossed(run, report):
        return report
    reference = exercise_reference(secrets)
    _judge_what_crossed(run, reference, report)
    _judge_the_schedule(run, reference, report)
    _judge_what_it_computed(run, reference, report)
    return report


ONLY_THE_ACTIVATION = "in a pipeline each stage computes its own part, and only the activations and their gradients cross"


def _judge_nothing_else_crossed(run: RunResult, report: ExerciseReport) -> bool:
    """Only the activations and their gradients crossed: a stage that received the other's data (rank 1's labels,
    rank 0's inputs) could compute the other stage's part itself."""
    around = side_channels(run)
    if around:
        report.mistakes.append(around)
        return False
    for r in run.ranks:
        sent = records(run)[r.rank].channel_bytes.get("sent_bytes", 0)
        if sent > MICRO_BATCHES * ACTIVATION_BYTES:
            what = "the activations" if r.rank == 0 else "the activations' gradients"
            report.mistakes.append(f"rank {r.rank} sent {sent:,} bytes point to point, more than the "
                                   f"{MICRO_BATCHES * ACTIVATION_BYTES:,} of {what}: {ONLY_THE_ACTIVATION}")
            return False
    collectives = sorted({c["op"] for r in run.ranks for c in records(run)[r.rank].collectives if "barrier" not in c["op"]})
    if collectives:
        report.mistakes.append(f"the ranks also ran {', '.join(collectives)}: {ONLY_THE_ACTIVATION}")
        return False
    return True


def _judge_what_crossed(run: RunResult, reference: dict, report: ExerciseReport) -> None:
    """Every micro-batch's activation went from rank 0 to rank 1, and its gradient back (as the launcher saw the
    sends), computed by stage 1 from what it received; stage 0's backwards ran from the gradients it received."""
    shape = list(reference["activations"][0].shape)
    sent, received = _messages(run, 0, 1, shape)
    missing = _first_not_crossed(sent, received, reference["activations"])
    if not sent or not received:
        report.mistakes.append(
            "the activations never crossed from rank 0 to rank 1 (no send of an 8 x 32 tensor from rank 0 that "
            "rank 1 received): stage 1 must work on what stage 0 computed, sent over the process group")
    elif missing is not None:
        report.mistakes.append(f"stage 0's output on micro-batch {missing} (rows {missing * MICRO_BATCH} to "
                               f"{(missing + 1) * MICRO_BATCH - 1} of the batch) never went from rank 0 to rank 1")
    else:
        report.confirmed.append("each micro-batch's activation went from rank 0 to rank 1 (seen by the launcher: "
                                "send and recv)")
    sent_back, received_back = _messages(run, 1, 0, shape)
    # The gradient of the whole batch's mean loss, or m times it (each micro-batch's mean loss, the gradients
    # divided by m at the end: as right).
    misses = [_first_not_crossed(sent_back, received_back, [scale * g for g in reference["activation_grads"]])
              for scale in (1, MICRO_BATCHES)]
    wrong_back = None if None in misses else misses[0]
    if not sent_back or not received_back:
        report.mistakes.append("no gradient reached stage 0 from rank 1: nothing of the activation's shape came back, "
                               "so stage 0's layers would learn nothing from the loss")
    elif wrong_back is not None:
        report.mistakes.append(f"what came back from rank 1 to rank 0 does not include the gradient of the loss (the "
                               f"whole batch's mean) with respect to micro-batch {wrong_back}'s activation")
    elif not all(m.get("grad_of_received") for m in sent_back):
        # The right values, but not computed from what arrived: rank 1 ran stage 0 itself and sent for show.
        report.mistakes.append("rank 1 sent back the right values, but not the gradient of the tensor it received "
                               "from rank 0: stage 1 did not compute from what stage 0 sent")
    elif not _every_gradient_received_was_used(records(run)[0].point_to_point, shape):
        # Positive evidence for stage 0: its backwards ran from the gradients that came back (handed to backward,
        # or in the graph), not from a loss rank 0 computed itself with the labels it learned some other way.
        report.mistakes.append("rank 0 received the gradients from rank 1, but no backward on rank 0 used one of them: "
                               "stage 0's gradients came from somewhere else. Where does stage 0's backward start?")
    else:
        report.confirmed.append("each activation's gradient, computed by stage 1 from the activation it received, "
                                "came back from rank 1 to rank 0, and stage 0's backwards ran from them")


def _every_gradient_received_was_used(calls: list[dict], shape: list[int]) -> bool:
    """Each receive of a gradient (rank 0's receives of the activation's shape) went into one of its backwards."""
    receives = [c for c in calls if c.get("op", "").endswith("recv")]
    gradients = {number for number, c in enumerate(receives) if c.get("shape") == shape}
    used = {number for c in calls if c.get("op") == "backward" for number in c.get("received_used", ())}
    return bool(gradients) and gradients <= used


def _micro_batches(count: int) -> str:
    return f"{count} micro-batch's" if count == 1 else f"{count} micro-batches'"


def _judge_the_schedule(run: RunResult, reference: dict, report: ExerciseReport) -> None:
    """1F1B: stage 0 ran each micro-batch's forward with autograd (seen saving its activations), held at most two
    micro-batches' activations at once, and sent the next micro-batch's activation before each backward; the last
    stage held one; and an order of calls that nccl also completes."""
    held = [records(run)[rank].held_for_backward for rank in (0, 1)]
    units = [one_micro_batch_held(0), one_micro_batch_held(1)]
    if not held[0]:
        report.mistakes.append("no activations were seen held on stage 0: the rank measures what autograd saves for "
                               "backward once my_inputs() is called; stage 0's forwards must run after it, with autograd")
        return
    seen = _held_activations.saved_in_all(held[0]) / units[0]
    if seen < MICRO_BATCHES - 0.5:
        report.mistakes.append(
            f"autograd was seen saving the activations of only {seen:.0f} of stage 0's {MICRO_BATCHES} forwards: the "
            "others ran where the rank cannot measure what they hold (under torch.no_grad, saved-tensor hooks of your "
            "own, or activation checkpointing). This exercise's memory is the schedule's: run each forward with "
            "plain autograd")
        return
    most = _held_activations.peak(held[0])
    if most > (IN_FLIGHT + 0.5) * units[0]:
        report.mistakes.append(f"stage 0 held the activations of {most / units[0]:.0f} micro-batches at once "
                               f"({most:,} bytes saved for backward; one micro-batch's are {units[0]:,}): stage 0 may "
                               f"hold at most {IN_FLIGHT}. When can a micro-batch's activations be let go?")
    else:
        report.confirmed.append(f"stage 0 held at most {_micro_batches(round(most / units[0]))} activations at once "
                                f"({most:,} bytes; one micro-batch's are {units[0]:,})")
    last = _held_activations.peak(held[1])
    if last > 1.5 * units[1]:
        report.mistakes.append(f"stage 1, the last stage, held the activations of {last / units[1]:.0f} micro-batches "
                               f"at once ({last:,} bytes; one micro-batch's are {units[1]:,}): in 1F1B the last stage "
                               "holds one (p − i with i = 1 of p = 2)")
    calls = [list(records(run)[rank].point_to_point) for rank in (0, 1)]
    late = _activation_sent_after_backward(calls, reference)
    if late is not None:
        report.mistakes.append(
            f"stage 0 ran micro-batch {late}'s backward before it sent micro-batch {late + 1}'s activation: stage 1, "
            "done with micro-batch {late}, has nothing to compute until that backward ends".replace("{late}", str(late)))
    else:
        report.confirmed.append("stage 0 sent each next micro-batch's activation before the previous one's backward: "
                                "stage 1 was kept fed")
    stuck = stuck_on_nccl(calls)
    if stuck:
        order = lambda number: {1: "1st", 2: "2nd", 3: "3rd"}.get(number, f"{number}th")  # noqa: E731
        where = " and ".join(f"rank {rank} in its {call['op']} {'to' if 'send' in call['op'] else 'from'} rank "
                             f"{1 - rank} (its {order(call.get('number', 0))} send or receive)"
                             for rank, call in sorted(stuck.items()))
        report.mistakes.append(
            f"this order finishes on gloo, but on GPUs it can hang, {where} each waiting for the other's: on nccl "
            "every send or receive, isend and irecv included, runs on the GPU after the rank's earlier ones with the "
            "same peer and may not complete until the other rank's matching call runs")
    else:
        report.confirmed.append("the order of the sends and receives completes on nccl too (where each runs on the GPU "
                                "after the earlier ones with the same peer)")


def _activation_sent_after_backward(calls: list[list[dict]], reference: dict) -> int | None:
    """The first micro-batch k whose backward on stage 0 ran before stage 0 sent micro-batch k + 1's activation (as
    rank 0's log orders its calls), or None. Micro-batches are told apart by the values sent; a backward by the
    gradient it used (the receive whose tensor it took, and which of rank 1's sends that receive matched)."""
    import torch

    def matches(message, expected) -> bool:
        return "values" in message and any(torch.allclose(torch.tensor(message["values"], dtype=torch.float64),
                                                          scale * expected.double().flatten(), atol=1e-5, rtol=1e-4)
                                           for scale in (1, MICRO_BATCHES))

    shape = list(reference["activations"][0].shape)
    sends = [(i, c) for i, c in enumerate(calls[0]) if c.get("op", "").endswith("send") and c.get("peer") == 1]
    sent_at = {k: next((i for i, c in sends if matches(c, a)), None) for k, a in enumerate(reference["activations"])}
    # Rank 1's gradients in the order it sent them: the n-th gradient rank 0 received is the n-th rank 1 sent.
    sent_back = [c for c in calls[1] if c.get("op", "").endswith("send") and c.get("peer") == 0 and c.get("shape") == shape]
    micro_of = [next((k for k, g in enumerate(reference["activation_grads"]) if matches(c, g)), None) for c in sent_back]
    receives = [i for i, c in enumerate(calls[0]) if c.get("op", "").endswith("recv")]  # numbered as the log numbers them
    gradient_receives = [n for n, i in enumerate(receives) if calls[0][i].get("shape") == shape
                         and calls[0][i].get("peer") in (1, None)]
    backward_at = {}
    for order, receive in enumerate(gradient_receives):
        k = micro_of[order] if order < len(micro_of) else None
        used = next((i for i, c in enumerate(calls[0]) if c.get("op") == "backward" and receive in c.get("received_used", ())),
                    None)
        if k is not None and used is not None:
            backward_at[k] = used
    for k in range(MICRO_BATCHES - 1):
        if sent_at.get(k + 1) is None or backward_at.get(k) is None:
            continue  # not told apart: what crossed is judged, and named, elsewhere
        if backward_at[k] < sent_at[k + 1]:  # positions in rank 0's log
            return k
    return None


def _judge_what_it_computed(run: RunResult, reference: dict, report: ExerciseReport) -> None:
    """The loss and both stages' gradients equal the unsplit model's on the exercise's batch."""
    import torch

    facts = [r.facts for r in run.ranks]
    if "loss" not in facts[1] or "grads" not in facts[0] or "grads" not in facts[1]:
        report.mistakes.append("keep the record(...) lines: rank 1 records the loss, both ranks their gradients")
        return
    if abs(facts[1]["loss"] - reference["loss"]) > 1e-5:
        report.mistakes.append(f"stage 1's loss {facts[1]['loss']:.6f} is not the unsplit model's "
                               f"{reference['loss']:.6f} on the exercise's batch (the mean over all 32 samples)")
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
        report.mistakes.append(f"the gradients of {wrong[0]} differ from the unsplit model's (the whole batch's mean "
                               "loss, summed over its micro-batches)")
    else:
        report.confirmed.append("both stages' gradients equal the unsplit model's")
