"""Lesson 6's exercise: a quarter of the bytes DDP sends per step, without changing the training.

The script trains a small MLP with DDP for STEPS steps of SGD, each rank on its own share of the step's
batch in MICRO_BATCHES micro-batches, and so all-reduces every gradient in float32 once per micro-batch. Both of
lesson 6's levers are needed: one all-reduce a step (`no_sync` for all but the last micro-batch, or no
micro-batches), and half the bytes a value (a communication hook). The checker computes the intended training itself, in
one process, from the exercise's model, data and seeds (`exercise_reference`): one step is the gradient
of the mean loss over every rank's share, which is what DDP's average computes. It judges the run on:
- what crossed between the ranks, as torch's flight recorder saw it (`records.RankRecords.collectives`) and the
  launcher counted the point-to-point bytes at torch's ProcessGroup class (`records.RankRecords.channel_bytes`);
  any use of a key-value store is named as a side channel, not counted: an all-reduce in every step, and on
  average at most a quarter of the bytes per step the script as given sends (half of one float32 all-reduce of
  every gradient), and at least an eighth (8 bits a value of one all-reduce, as torch's quantization hooks send;
  below it, what torch ships only approximates the gradient, as PowerSGD does). Every collective after DDP's wrap counts,
  not only all-reduces: a hook that all-reduces half the bytes for show and all-gathers the float32
  gradients is not sending less;
- the ranks ending with bitwise equal weights;
- those weights being the reference's to within WEIGHT_TOLERANCE of how far training moved them
  (float16's rounding stays well inside: 0.01 % to 0.2 % here; PowerSGD's low-rank approximation changes
  the trajectory by 10 % or more on this model).

Each rank's share comes from its secret (`ddp_helpers.rank_secret`, only that rank's process is handed it),
so no rank can compute another's gradient; the checker reads every secret from the run folder. Weights
equal to the float32 training's to float32 precision (ROUNDING_AT_LEAST) mean float32 gradients crossed,
through a channel the byte count did not see (the default store, a file), and do not pass; a flight
recorder that lost the run's first collectives (flooded, or TORCH_FR_BUFFER_SIZE shrunk) is named, not
trusted. And, the positive evidence: every step, each rank's DDP model handed DDP's all-reduces its own share's
gradient (the launcher logs each parameter's, `_all_reduce_log.log_ddp_gradients`, from `my_batch`'s first call),
within OWN_GRADIENT_TOLERANCE of the intended training's: ranks that learned each other's shares by another road
(a socket) and trained on the whole batch are judged wrong, however right their bytes and weights.
"""

from __future__ import annotations

import math

from ...exercises import (ExerciseReport, distance, per_share_gradients, regression_teacher, side_channels,
                          train_on_every_share, opening, recorder_lost)
from ....flight_recorder import ALL_REDUCE_OPS, torch_dtype_name
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

STEPS = 30
BATCH = 32  # per rank and step
MICRO_BATCHES = 2  # as the script is given: each all-reduces every gradient in float32
# Small enough that rounding does not compound chaotically over the run, whatever a run's data: with float16
# gradients the weights end 0.008 % to 0.22 % of the training's distance from float32's (300 simulated runs
# of random secrets; at 0.2, up to 2.9 %, over the 1 % allowed).
LEARNING_RATE = 0.05
INPUTS, HIDDEN = 32, 128
WEIGHT_TOLERANCE = 0.01  # of the distance the reference's weights moved from the start
# Closer than this (of the same distance) is float32's summation order, not a half-precision rounding: float16
# gradients put the weights at least 8e-5 away, plain float32 averaging about 4e-7 (simulated, as above).
ROUNDING_AT_LEAST = 1e-5
TINY_BYTES = 64  # an all-reduce this small is a logged loss or a flag, not a gradient


def exercise_model():
    """The model every rank starts from (seeded: the same weights on every rank)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


def exercise_batch(step: int, secret: int):
    """The share of step `step`'s batch of the rank whose secret is `secret`: (inputs, targets), BATCH samples."""
    import torch

    inputs = torch.randn(BATCH, INPUTS, generator=torch.Generator().manual_seed((secret + step) % 2**63))
    with torch.no_grad():
        return inputs, regression_teacher(INPUTS)(inputs)


def my_batch(step: int):
    """In a rank: this rank's share of step `step`'s batch, from the secret only this rank's process is handed. From
    its first call the launcher logs what the rank's DDP model hands DDP's all-reduces (`_all_reduce_log`), the
    evidence the checker asks for."""
    from ... import _all_reduce_log

    _all_reduce_log.log_ddp_gradients()
    return exercise_batch(step, rank_secret())


def float32_average_reference(secrets: list[int]) -> list:
    """The weights after the training as float32 data parallelism computes it: each rank's share's gradient on its
    own, summed over the ranks and divided by their number (what DDP's average, or float32 gradients passed any
    other way, give), not the whole batch's gradient in one pass: the two differ by float32's rounding, and a
    rounding can flip a ReLU now and then, which moves the whole trajectory. Weights this close mean float32
    gradients crossed."""
    import torch

    model = exercise_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        shares = [exercise_batch(step, secret) for secret in secrets]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for inputs, targets in shares:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            total = [t + p.grad for t, p in zip(total, model.parameters())]
        for p, summed in zip(model.parameters(), total):
            p.grad = summed / len(secrets)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def own_gradient_sums(secrets: list[int]) -> list[list[list[float]]]:
    """Per step, per rank, the sum of each parameter's gradient of the rank's own share's loss, along the intended
    training (`exercise_reference`'s): what each rank's DDP model hands DDP's all-reduces, to float16 training's
    drift."""
    import torch

    model = exercise_model()
    return per_share_gradients(
        model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
        lambda step: [exercise_batch(step, secret) for secret in secrets], STEPS, torch.nn.functional.mse_loss,
        lambda parameters: [float(p.grad.double().sum()) for p in parameters])[0]


def _own_gradients_unseen(run: RunResult, secrets: list[int]) -> dict[int, str]:
    """Per rank, what shows that its DDP model did not hand DDP its own share's gradient (empty: all did). The k-th
    logged gradient of parameter i is step k's; each step's is compared with the rank's own share's gradient and
    with the whole batch's (the average over the shares), along the intended training: float16 training drifts
    from it a little, so a step's handed gradient is judged by which of the two it is closer to, and a rank whose
    gradients were the whole batch's in most steps did not train on its own share alone."""
    import math

    expected = own_gradient_sums(secrets)
    unseen = {}
    for rank in run.ranks:
        by_parameter: dict[int, list[float]] = {}
        for call in records(run)[rank.rank].handed_to_collectives:
            if call.get("collective") == "ddp" and "sum" in call:
                by_parameter.setdefault(call["parameter"], []).append(call["sum"])
        if len(by_parameter) != len(expected[0][0]) or any(len(sums) < STEPS for sums in by_parameter.values()):
            unseen[rank.rank] = "no gradient of its DDP model reached DDP's all-reduces in every step"
            continue
        handed = max(len(sums) for sums in by_parameter.values())
        if handed != STEPS:  # a backward per micro-batch that DDP all-reduced: whose share each was cannot be told
            unseen[rank.rank] = (f"its DDP model handed DDP's all-reduces {handed} gradients in {STEPS} steps, not one a "
                                 "step, so the checker cannot tell them from the whole batch's")
            continue
        closer_to_the_whole = []
        for step in range(STEPS):
            mine = [by_parameter[i][step] for i in range(len(by_parameter))]
            own = expected[step][rank.rank]
            whole = [sum(per_rank[i] for per_rank in expected[step]) / len(expected[step]) for i in range(len(own))]
            if math.dist(mine, whole) < math.dist(mine, own):
                closer_to_the_whole.append(step)
        if len(closer_to_the_whole) > STEPS // 5:
            unseen[rank.rank] = (f"in {len(closer_to_the_whole)} of {STEPS} steps its DDP model handed DDP the whole "
                                 "batch's gradient rather than its own share's")
    return unseen


def parameter_bytes() -> int:
    """What plain DDP all-reduces per step: every gradient, in float32."""
    return sum(p.numel() * 4 for p in exercise_model().parameters())


def exercise_reference(secrets: list[int]) -> list:
    """The weights after the intended training on ranks with these secrets, computed in one process: each
    step's gradient is the mean loss's over every rank's share (shares of equal size), as DDP averages it."""
    return train_on_every_share(exercise_model(), lambda step: [exercise_batch(step, secret) for secret in secrets],
                                STEPS, LEARNING_RATE)


def all_reduce_bytes(collectives: list[dict]) -> list[int]:
    """The bytes of each all-reduce a rank called, in order, from its flight recorder's entries."""
    return [_tensor_bytes(entry["shapes"], entry["dtypes"]) for entry in collectives
            if entry["op"] in ALL_REDUCE_OPS]


def _tensor_bytes(shapes, dtypes) -> int:
    import torch

    return sum(math.prod(shape) * getattr(torch, torch_dtype_name(dtype)).itemsize for shape, dtype in zip(shapes, dtypes))


def exchanged_bytes(collectives: list[dict]) -> list[int]:
    """The bytes of everything a rank put into a collective from its first all-reduce on (before it: DDP's
    wrap, checking shapes and broadcasting rank 0's weights, once), barriers aside."""
    sizes, started = [], False
    for entry in collectives:
        started = started or entry["op"] in ALL_REDUCE_OPS
        if started and "barrier" not in entry["op"]:
            sizes.append(_tensor_bytes(entry["shapes"], entry["dtypes"]))
    return sizes


def rank_bytes(rank) -> int:
    """What a rank sent in the run: its collectives' bytes (tiny ones aside), and every point-to-point byte
    it sent, however its script reached the process group (`records.RankRecords.channel_bytes`)."""
    collectives = sum(size for size in exchanged_bytes(rank.collectives) if size > TINY_BYTES)
    return collectives + rank.channel_bytes.get("sent_bytes", 0)


@records_progress  # the learner's progress notes whether this run passed
def check_compression_exercise(run: RunResult) -> ExerciseReport:
    """Name what is wrong with the learner's compressed training, or confirm it (see the module docstring)."""
    report = ExerciseReport(verdict_when_passed="All checks pass: every step sent at most a quarter of the bytes the "
                                                "script as given sends, and the training is the uncompressed one, to "
                                                "float16's rounding.")
    # Side channels are judged with the bytes.
    secrets = opening(run, report, ranks_for="with one there is nothing to send", facts=("weights",), channels=False)
    if secrets is None:
        return report
    within_budget = _judge_bytes(run, report)
    _judge_weights(run, report, secrets, within_budget)
    return report


def _judge_bytes(run: RunResult, report: ExerciseReport) -> bool:
    """Whether the bytes were judged within the budget: at most a quarter of what the script as given sends (and
    at least an eighth)."""
    around = side_channels(run, files=False)
    if around:
        report.mistakes.append(around)
        return False
    dropped = recorder_lost(run)
    if dropped:
        report.mistakes.append(
            f"torch's flight recorder no longer holds the first collectives of rank(s) {dropped} (it keeps the last "
            "TORCH_FR_BUFFER_SIZE, 2000 by default): the bytes of the run cannot be counted, so they are not taken "
            "as within the budget. Leave the recorder and its size alone, and send only what the training needs")
        return False
    full = parameter_bytes()
    sent = [all_reduce_bytes(records(run)[r.rank].collectives) for r in run.ranks]
    # Tiny all-reduces (a loss averaged for the log) are not gradients.
    gradients = [[size for size in sizes if size > TINY_BYTES] for sizes in sent]
    counts = {len(sizes) for sizes in gradients}
    # The bytes: every collective and message, not only the all-reduces counted above.
    total = max(rank_bytes(seen) for seen in records(run))
    per_step = total / STEPS
    if min(counts) < STEPS:
        report.mistakes.append(f"the ranks all-reduced {min(counts)} times in {STEPS} steps (seen by the flight recorder): "
                               "every step must average the gradients")
        return False
    given = MICRO_BATCHES * full  # float32 gradients, all-reduced once per micro-batch
    if per_step > given / 4:
        calls = len(gradients[0])
        carried = sum(gradients[0]) / calls / full  # of a float32 all-reduce of every gradient
        report.mistakes.append(
            f"each step sent {per_step:,.0f} bytes on average, {per_step / given:.0%} of the {given:,} the script as "
            f"given sends ({MICRO_BATCHES} all-reduces of every float32 gradient): over a quarter. Rank 0 made "
            f"{calls} gradient all-reduces in {STEPS} steps, {calls / STEPS:g} a step, each carrying {carried:.0%} "
            "of the float32 gradients' bytes: a step's bytes are the one times the other")
        return False
    if per_step < given / 8:
        report.mistakes.append(f"each step sent only {per_step:,.0f} bytes, {per_step / given:.0%} of the script as "
                               f"given: under an eighth, less than 8 bits a value of one all-reduce of the gradients. "
                               "That is a lossy compression (PowerSGD's low-rank approximation, say), which only "
                               "approximates the average")
        return False
    report.confirmed.append(f"each step sent {per_step:,.0f} bytes, {per_step / given:.0%} of the {given:,} the script "
                            "as given sends (counted from every collective and message the ranks sent)")
    return True


def _judge_weights(run: RunResult, report: ExerciseReport, secrets: list[int], within_budget: bool) -> None:
    import torch

    weights = [[w.cpu().float() for w in r.facts["weights"]] for r in run.ranks]
    if any(len(w) != len(weights[0]) or any(not torch.equal(a, b) for a, b in zip(w, weights[0])) for w in weights):
        report.mistakes.append("the ranks ended with different weights: they stepped on different gradients. Every "
                               "rank must step on the same averaged gradient: nothing of its own may be added after "
                               "a step's last all-reduce, and a hook must return the same values on every rank")
        return
    report.confirmed.append("every rank ended with bitwise the same weights")
    reference = exercise_reference(secrets)
    start = [p.detach() for p in exercise_model().parameters()]
    if [w.shape for w in weights[0]] != [r.shape for r in reference]:
        report.mistakes.append("the recorded weights are not the exercise model's: keep its model and record line")
        return
    moved, off = distance(reference, start), distance(weights[0], reference)
    if off > WEIGHT_TOLERANCE * moved:
        report.mistakes.append(
            f"the weights are {off / moved:.1%} of the training's distance away from the uncompressed training's "
            f"(allowed: {WEIGHT_TOLERANCE:.0%}): the training changed, not only what was sent. A lossy compression "
            "(PowerSGD's low-rank approximation) changes each gradient, and so does a micro-batch's loss counted "
            "twice or left out; rounding to 16 bits only rounds it")
    elif within_budget and (off32 := min(off, distance(weights[0], float32_average_reference(secrets)))) \
            < ROUNDING_AT_LEAST * moved:
        report.mistakes.append(
            f"the weights are the float32 training's to float32's precision ({off32 / moved:.0e} of the training's "
            "distance): float32 gradients crossed between the ranks, whatever the flight recorder counted. Fewer "
            "bytes per value cannot carry a float32 value: the weights would show the rounding")
    else:
        report.confirmed.append(f"the weights are the uncompressed training's: they differ from them by "
                                f"{off / moved:.2%} of how far training moved them (allowed: {WEIGHT_TOLERANCE:.0%})")
        # Whose gradients crossed, once the bytes are right (the script as given hands DDP two a step, each its own).
        unseen = _own_gradients_unseen(run, secrets) if within_budget else {}
        if unseen:
            report.mistakes.append(
                "the weights are right, but the launcher did not see each rank's own gradient go into the "
                "all-reduces: " + "; ".join(f"rank {r}: {why}" for r, why in unseen.items())
                + ". The other ranks' data reached each rank some other way: what must each rank's hook send?")
