"""Lesson 7's exercise checker: the learner's MyDDP judged on what the run did (`check_my_ddp_exercise`).

It computes the intended training itself, in one process (`exercise_reference`), and judges:
- torch's own DDP not used (a `Reducer` built, or DDP's check of the parameters at the wrap in the flight
  recorder: an all_gather of one int64, then a broadcast of int64 metadata), and nothing passed around the
  collectives (a key-value store, point-to-point sends, files);
- the collectives: before the first all-reduce, floating-point broadcasts only (the starting weights);
  after it, all-reduces only, in buckets of the cap, counted over the whole run in torch's flight recorder
  as one of the two readings of "buckets up to a cap" (`accepted_buckets`);
- the weights: every rank's bitwise equal, and the reference's to float32's summation order (a sum instead of
  an average named);
- what the buckets carried: the sum of each `dist.all_reduce` input (logged by the launcher once
  `exercise_model()` asks, `_all_reduce_log.log_sums`) is the rank's own gradients in a bucket, on the
  intended trajectory: buckets of zeros sent for show fail even where the weights are right;
- the overlap: in every step, an all-reduce created (the flight recorder's clock) while the backward was
  accumulating gradients, and not waited for before the next gradient was accumulated;
- the waits: in every step, every all-reduce waited for before the optimizer stepped (as many waits on works
  as all-reduces, one after the last; or a future's wait after the last, which may cover several);
- and, when all of that holds, the same script again on 3 ranks: an average hard-wired for 2 does not pass.
"""

from __future__ import annotations

from ...exercises import ExerciseReport, distance, opening, run_again, side_channels
from ....flight_recorder import ALL_REDUCE_OPS
from ....result import RunResult
from . import values
from .exercise import (BACKWARD_FACT, BUCKET_CAP_BYTES, STEPS, WEIGHT_TOLERANCE, exercise_reference,
                               local_gradients, plain_model)
from ...records import records
from ...progress import records_progress

SECOND_WORLD = 3
SECOND_WORLD_TIMEOUT_S = 120
FLOATING = ("float", "double", "half", "bfloat16", "float32", "float64", "float16")


def accepted_bucket_parameters(cap_bytes: int = BUCKET_CAP_BYTES) -> dict[str, list[list[int]]]:
    """The parameters (indices in `model.parameters()`) of each bucket, in reverse order, under the two readings
    of "buckets up to a cap": torch DDP's (a bucket closes once it holds at least the cap: reducer.cpp's
    compute_bucket_assignment_by_size) and "never over the cap" (a parameter larger than the cap alone)."""
    parameters = list(plain_model().parameters())
    order = [(index, parameters[index].numel() * parameters[index].element_size())
             for index in reversed(range(len(parameters)))]
    at_least, never_over = [], []
    bucket, size = [], 0
    for index, nbytes in order:  # DDP's rule
        bucket, size = bucket + [index], size + nbytes
        if size >= cap_bytes:
            at_least.append(bucket)
            bucket, size = [], 0
    at_least += [bucket] if bucket else []
    bucket, size = [], 0
    for index, nbytes in order:
        if bucket and size + nbytes > cap_bytes:
            never_over.append(bucket)
            bucket, size = [], 0
        bucket, size = bucket + [index], size + nbytes
    never_over.append(bucket)
    return {"torch DDP's rule": at_least, "the never-over-the-cap rule": never_over}


def accepted_buckets(cap_bytes: int = BUCKET_CAP_BYTES) -> dict[str, list[int]]:
    """The number of values in each bucket, under each reading of the cap (`accepted_bucket_parameters`)."""
    sizes = [p.numel() for p in plain_model().parameters()]
    return {rule: [sum(sizes[i] for i in bucket) for bucket in buckets]
            for rule, buckets in accepted_bucket_parameters(cap_bytes).items()}


def gradient_all_reduces(collectives) -> list[dict]:
    """A rank's all-reduces, in order: in this exercise every one carries gradients (the loop logs no loss)."""
    return [c for c in collectives if c["op"] in ALL_REDUCE_OPS]


def wrapped_torch_ddp(collectives) -> bool:
    """Whether a rank's collectives show torch DDP's wrap: its check of the parameters across the ranks
    (`_verify_param_shape_across_processes`: an all_gather of one int64, then a broadcast of int64 metadata)."""
    ops = [(c["op"], c["shapes"], c["dtypes"]) for c in collectives]
    return any(op == "all_gather" and shapes == [[1]] and dtypes[:1] in (["long"], ["int64"])
               and ops[i + 1][0] == "broadcast" and ops[i + 1][2][:1] in (["long"], ["int64"])
               for i, (op, shapes, dtypes) in enumerate(ops[:-1]))


FACTS = ("weights", BACKWARD_FACT)
KEEP_THE_FACTS = ("keep the model from exercise_model(), the training loop and the record(\"weights\", ...) line: the "
                  "checker reads every rank's weights and when each backward ran")


@records_progress  # the learner's progress notes whether this run passed
def check_my_ddp_exercise(run: RunResult, *, second_world: bool = True) -> ExerciseReport:
    """Name what is wrong with the learner's MyDDP, or confirm it (see the module docstring)."""
    report = ExerciseReport(verdict_when_passed="All checks pass: your MyDDP trains as DDP does, in buckets of the "
                                                "cap, overlapped with the backward, at two world sizes.")
    if not _judge(run, report) or not second_world:
        return report
    other = SECOND_WORLD if len(run.ranks) != SECOND_WORLD else 2
    again = run_again(run, other, SECOND_WORLD_TIMEOUT_S)
    if not again.ok:
        report.mistakes.append(f"run again by the checker on {other} ranks, the cell failed: {again.summary()[:300]}")
        return report
    before = len(report.confirmed)
    if _judge(again, report):
        report.confirmed[before:] = [f"and again on {other} ranks, run by the checker: every check above holds"]
    else:
        report.confirmed[before:] = []
        report.mistakes[:] = [f"run again by the checker on {other} ranks: {m}" for m in report.mistakes]
    return report


def _judge(run: RunResult, report: ExerciseReport) -> bool:
    """Add the verdicts on one run to `report`; whether it passed."""
    mistakes = len(report.mistakes)
    # Side channels are judged below, beside the collectives that are not the buckets'.
    secrets = opening(run, report, ranks_for="with one there is nothing to average", channels=False, facts=FACTS,
                      facts_hint=KEEP_THE_FACTS)
    if secrets is None:
        return False
    if any(r.facts[BACKWARD_FACT]["reducers_built"] or wrapped_torch_ddp(records(run)[r.rank].collectives) for r in run.ranks):
        report.mistakes.append("the run used torch's DistributedDataParallel (its Reducer was built, or the flight "
                               "recorder shows its check of the parameters at the wrap): the exercise is to do its "
                               "work in MyDDP yourself")
        return False
    around = side_channels(run) or _other_collectives(run)
    if around:
        report.mistakes.append(around)
        return False
    if not any(gradient_all_reduces(records(run)[r.rank].collectives) for r in run.ranks):
        report.mistakes.append("no rank all-reduced a gradient: each rank stepped with its own batch's gradient alone, "
                               "and the ranks drifted apart")
        return False
    stepped = {len(r.facts[BACKWARD_FACT]["steps"]) for r in run.ranks}
    if stepped != {STEPS}:
        report.mistakes.append(f"the ranks' optimizers stepped {'/'.join(map(str, sorted(stepped)))} times, not "
                               f"{STEPS}: keep the training loop as given")
        return False
    lost = [seen.rank for seen in records(run)
            if not gradient_all_reduces(seen.collectives) or seen.collectives[0].get("number", 1) != 1]
    if lost:
        report.mistakes.append(f"torch's flight recorder holds no all-reduce of rank(s) {lost}, or no longer holds "
                               "their first collectives (it keeps the last 2000, or TORCH_FR_BUFFER_SIZE): was it "
                               "turned off, flooded, or its size changed? The buckets cannot be counted from a "
                               "partial record")
        return False
    weights_right = _judge_weights(run, report, secrets)
    rule = _judge_buckets(run, report)
    if rule:
        if weights_right:
            _judge_contents(run, report, secrets, rule)
        if _judge_overlap(run, report) is not None:
            _judge_waits(run, report)
    return len(report.mistakes) == mistakes


def _other_collectives(run: RunResult) -> str | None:
    """A mistake naming a collective that is neither a gradient bucket's all-reduce nor, before the first one,
    a broadcast of floating-point values (the starting weights), or None."""
    for r in run.ranks:
        started = False
        for call in records(run)[r.rank].collectives:
            started = started or call["op"] in ALL_REDUCE_OPS
            allowed = (call["op"] in ALL_REDUCE_OPS or "barrier" in call["op"]
                       or (not started and call["op"] == "broadcast" and set(call["dtypes"]) <= set(FLOATING)))
            if not allowed:
                return (f"rank {r.rank} called {call['op']} ({values(call):,} {'/'.join(call['dtypes'])} values) "
                        + ("during the training" if started else "before the training") + ": data crossed between "
                        "the ranks outside the gradients' buckets. Only the buckets' all-reduces (and, before the "
                        "training, broadcasts of the starting weights) are allowed")
    return None


def _judge_weights(run: RunResult, report: ExerciseReport, secrets: list[int]) -> bool:
    import torch

    weights = [[w.cpu().float() for w in r.facts["weights"]] for r in run.ranks]
    if any(len(w) != len(weights[0]) or any(not torch.equal(a, b) for a, b in zip(w, weights[0])) for w in weights):
        report.mistakes.append("the ranks ended with different weights: every rank must step with the same averaged "
                               "gradients. Was each all-reduce's result used only after it had finished, and did "
                               "every gradient get its bucket's result?")
        return False
    reference = exercise_reference(secrets)
    if [w.shape for w in weights[0]] != [r.shape for r in reference]:
        report.mistakes.append("the recorded weights are not the exercise model's: keep its model and record line")
        return False
    moved = distance(reference, [p.detach() for p in plain_model().parameters()])
    off = distance(weights[0], reference)
    if off <= WEIGHT_TOLERANCE * moved:
        report.confirmed.append(f"every rank ended with bitwise the same weights, those of one process training on "
                                f"every rank's data, to {off / moved:.0e} of how far training moved them (float32's "
                                "summation order)")
        return True
    elif distance(weights[0], exercise_reference(secrets, summed=True)) <= WEIGHT_TOLERANCE * moved:
        report.mistakes.append(f"the ranks summed their gradients and did not average them: the weights are those of "
                               f"a {len(run.ranks)} times larger learning rate")
    else:
        report.mistakes.append(f"every rank ended with the same weights, but {off / moved:.2g} of the training's "
                               "distance away from one process training on every rank's data: a gradient was "
                               "stepped with something other than the average over the ranks")
    return False


def _judge_buckets(run: RunResult, report: ExerciseReport) -> str | None:
    """The rule the buckets followed on every rank, or None with the mistake added."""
    accepted = accepted_buckets()
    parameter_sizes = {p.numel() for p in plain_model().parameters()}
    for r in run.ranks:
        calls = gradient_all_reduces(records(run)[r.rank].collectives)
        sizes = [values(c) for c in calls]
        for rule, buckets in accepted.items():
            per_step = len(buckets)
            if len(sizes) == STEPS * per_step and all(
                    sorted(sizes[i:i + per_step]) == sorted(buckets) for i in range(0, len(sizes), per_step)):
                break
        else:
            if all(size in parameter_sizes for size in sizes) and len(sizes) > STEPS * max(map(len, accepted.values())):
                said = f"{len(sizes)} times in {STEPS} steps, one per parameter: the cap did not group them"
            elif len(sizes) == STEPS:
                said = f"{len(sizes)} times in {STEPS} steps, the whole model at once: the cap did not split it"
            else:
                said = f"{len(sizes)} times in {STEPS} steps, not in the buckets a cap of {BUCKET_CAP_BYTES:,} bytes makes"
            counts = " or ".join(f"{len(b)} a step by {rule}" for rule, b in accepted.items())
            report.mistakes.append(f"rank {r.rank} all-reduced its gradients {said}. Parameters in reverse order, in "
                                   f"buckets of about {BUCKET_CAP_BYTES:,} bytes, make {counts}")
            return None
    report.confirmed.append(f"every rank all-reduced its gradients in {len(sizes) // STEPS} buckets a step ({rule}), "
                            f"{len(sizes)} all-reduces in {STEPS} steps, as torch's flight recorder saw them")
    return rule


def _judge_contents(run: RunResult, report: ExerciseReport, secrets: list[int], rule: str) -> None:
    """Each rank's all-reduces carried its own gradients: each call's sum (logged as `dist.all_reduce` was
    handed it) is the sum of the rank's own share's gradients in one bucket, scaled by 1/W or not. Judged
    when the weights are the intended training's: the gradients are then those of its trajectory."""
    buckets = accepted_bucket_parameters()[rule]
    gradients = local_gradients(secrets)
    world = len(run.ranks)
    for r in run.ranks:
        # A small tensor's values are logged whole (`_all_reduce_log.MAX_VALUES`), a larger one's sum.
        seen = records(run)[r.rank]
        carried = [call["sum"] if "sum" in call else sum(call["values"]) if "values" in call else None
                   for call in seen.all_reduced]
        if len(carried) != len(gradient_all_reduces(seen.collectives)) or None in carried:
            report.mistakes.append(f"rank {r.rank}: what its all-reduces carried could not be read: the checker reads "
                                   "what each dist.all_reduce call is handed (all_reduce_coalesced, a process "
                                   "group's own allreduce and functional collectives it cannot read), and the "
                                   "flight recorder saw "
                                   f"{len(gradient_all_reduces(seen.collectives))} all-reduces against {len(carried)} such calls")
            return
        for step in range(STEPS):
            own = gradients[step][r.rank]
            expected = [(float(sum(own[i].double().sum() for i in bucket)),
                         float(sum(own[i].double().abs().sum() for i in bucket))) for bucket in buckets]
            for value in carried[step * len(buckets):(step + 1) * len(buckets)]:
                if not any(abs(value - total * scale) <= 1e-4 * magnitude * scale + 1e-9
                           for total, magnitude in expected for scale in (1.0, 1.0 / world)):
                    report.mistakes.append(
                        f"rank {r.rank}: in step {step} an all-reduce carried values that sum to {value:.6g}, not its own "
                        "batch's gradients in a bucket: every rank must send the gradients it computed itself")
                    return
    report.confirmed.append("every rank's all-reduces carried its own batch's gradients, bucket by bucket")


def _judge_overlap(run: RunResult, report: ExerciseReport) -> bool | None:
    """In every step, some all-reduce started while the backward was accumulating gradients, and ran while it
    went on: no wait for it before the next gradient was accumulated (a wait in a hook stops the backward)."""
    running = []
    for r in run.ranks:
        steps = r.facts[BACKWARD_FACT]["steps"]
        created = [c.get("started_ns") for c in gradient_all_reduces(records(run)[r.rank].collectives)]
        if None in created:
            report.mistakes.append("this torch's flight recorder does not time its entries: the overlap cannot be judged")
            return None
        inside = [[t for t in created if step["accumulated_ns"][0] <= t <= step["accumulated_ns"][-1]] for step in steps]
        if len(steps) < STEPS or not all(inside):
            late = sum(not started for started in inside) + max(0, STEPS - len(steps))
            report.mistakes.append(
                f"rank {r.rank}: in {late} of {STEPS} steps no all-reduce started while the backward was still "
                "computing gradients: every bucket waited for the whole backward, and nothing overlapped")
            return False
        ran_on = [sum(_ran_while_backward_went_on(t, step) for t in started) for step, started in zip(steps, inside)]
        if min(ran_on) == 0:
            report.mistakes.append(
                f"rank {r.rank}: in {sum(n == 0 for n in ran_on)} of {STEPS} steps every all-reduce started inside the "
                "backward was waited for before the next gradient was computed: the backward stood still while each "
                "one ran, and nothing overlapped")
            return False
        running += ran_on
    per_step = len(gradient_all_reduces(records(run)[0].collectives)) // STEPS
    share = f"{min(running)}" if min(running) == max(running) else f"{min(running)} to {max(running)}"
    report.confirmed.append(f"in every step, on every rank, {share} of the {per_step} buckets' "
                            "all-reduces started inside the backward and ran while it went on computing gradients")
    return True


def _ran_while_backward_went_on(created_ns: int, step: dict) -> bool:
    """Whether an all-reduce created at `created_ns` was not waited for before the backward accumulated its next
    gradient."""
    following = [t for t in step["accumulated_ns"] if t > created_ns]
    return bool(following) and not any(created_ns < t < following[0] for t, _ in step["waited"])


def _judge_waits(run: RunResult, report: ExerciseReport) -> None:
    """In every step, every all-reduce was waited for before the optimizer stepped: as many waits on a work as
    all-reduces started since the step's first one, one of them after the last, or a future's wait (which may
    cover several) after the last. An async all-reduce's result is only there once waited for."""
    for r in run.ranks:
        steps = r.facts[BACKWARD_FACT]["steps"]
        created = [c["started_ns"] for c in gradient_all_reduces(records(run)[r.rank].collectives)]
        unwaited = 0
        for step in steps:
            mine = [t for t in created if step["accumulated_ns"][0] <= t <= step["stepped_ns"]]
            waits = [(t, kind) for t, kind in step["waited"] if min(mine, default=0) < t < step["stepped_ns"]]
            after_last = [kind for t, kind in waits if mine and t > max(mine)]
            if mine and not ("future" in after_last or (after_last and sum(kind == "work" for _, kind in waits) >= len(mine))):
                unwaited += 1
        if unwaited:
            report.mistakes.append(
                f"rank {r.rank}: in {unwaited} of {len(steps)} steps the optimizer stepped before every all-reduce of "
                "the step had been waited for: an all-reduce's result may not have arrived when the step read the "
                "gradients")
            return
