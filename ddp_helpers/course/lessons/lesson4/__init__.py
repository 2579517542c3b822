"""Lesson 4 (launching jobs with torchrun): reading steps out of the ranks' output, and the exercise
checker.

The exercise is a training script that snapshots after every step and resumes from its snapshot when
torchrun restarts it; it is run with rank 1 killed after step 5 and one restart allowed. It is not the
lesson's resilient training: two things decide its steps that no `state_dict` and no global random
state hold, and as given it saves neither (each rank's own `torch.Generator` for its input noise, and
a running average of the gradient's norm, a Python number, that the clipping reads). Copying the
lesson's recipe does not fix it; applying its rule does.

The checker trusts nothing the script says about itself: it reads the steps each attempt printed (as the
launcher saw them) and holds the attempt after the restart to the gradient all-reduces torch's flight
recorder saw it make (one step's worth per printed step: a restart that trains from step 0 again and hides
the lines it printed before does not pass), runs its own copy of the exercise as given (the same model,
data, noise and clipping: `reference.py`) without a kill at the same world size and backend, and compares
the final snapshots bitwise: the weights and the optimizer's momentum. So a "fix" that changes the
training itself (reseeding every step, no noise, no clipping, one noise stream for every rank) fails.
Each rank seeds its noise with its secret (`ddp_helpers.rank_secret`, the same after a restart), which the
reference run is handed rank by rank: no rank can rebuild another rank's generator, it must be brought
back from a snapshot. What crossed between the ranks must be seen crossing: the other ranks' random states
in rank 0's snapshot must each have been handed to a collective (the launcher digests the byte tensors a
rank hands one); a rank keeping its own state in its own file moves nothing between ranks, and is asked
for nothing. The hints read the run: where each rank's generator ended, against the reference's.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from ...exercises import FAILED, TIMED_OUT, ExerciseReport, opening
from ....flight_recorder import ALL_REDUCE_OPS
from ....result import RunResult
from ...records import records
from ...progress import records_progress

_STEP_DONE = re.compile(r"^step (\d+) done", flags=re.M)
SNAPSHOT_NAME = "snapshot.pt"
REFERENCE_SCRIPT = Path(__file__).with_name("reference.py")


def steps_done(text: str) -> list[int]:
    """The step numbers in lines "step N done", in order."""
    return [int(number) for number in _STEP_DONE.findall(text)]


@records_progress  # the learner's progress notes whether this run passed
def check_resume_exercise(run: RunResult) -> ExerciseReport:
    """Name what keeps the killed-and-restarted run from ending as an uninterrupted one, or confirm it does."""
    report = ExerciseReport(verdict_when_passed="All checks pass: killed and restarted, the training ends bitwise "
                                                "where an uninterrupted run does.")
    if not run.ok:
        report.mistakes.append(TIMED_OUT if run.timed_out else FAILED)
        return report
    if run.restarts == 0:
        report.mistakes.append("no rank was killed, so nothing was tested: rank 1 is killed once it prints "
                               "'step 5 done' (keep that print line)")
        return report
    mine = _final_snapshot(run)  # read before anything else runs
    secrets = opening(run, report, at_least=1, ranks_for="", files=False)  # the snapshot's files are the exercise's
    if secrets is None:
        return report
    expected, theirs, shapes, all_reduces = _reference(run, secrets)
    _judge_steps(run, expected, report, shapes, all_reduces / max(len(expected), 1))
    _judge_snapshots(mine, theirs, report)
    if not report.mistakes:
        _judge_states_crossed_through_collectives(run, mine, report)
    return report


def _judge_states_crossed_through_collectives(run: RunResult, snapshot: dict, report: ExerciseReport) -> None:
    """Positive evidence for what crossed between the ranks: the random states in rank 0's snapshot other than
    (perhaps) rank 0's own must each have been handed to a collective or sent by a rank (the launcher digests every
    byte tensor a rank hands a collective, and each one a rank sends). A snapshot with the other ranks' states in it, that no collective carried, got them
    by another road. Nothing is asked where nothing crossed (each rank keeping its own state in its own file)."""
    from ..._all_reduce_log import byte_digests

    states = set(byte_digests({key: value for key, value in snapshot.items() if key not in ("model", "optimizer")}))
    handed = {digest for r in run.ranks for call in records(run)[r.rank].handed_to_collectives for digest in call.get("digests", ())}
    sent = {call["digest"] for r in run.ranks for call in records(run)[r.rank].point_to_point if "digest" in call}
    unseen = states - handed - sent
    if len(states) >= 2 and len(unseen) > 1:
        report.mistakes.append(
            f"the snapshot holds {len(states)} random states, and {len(unseen)} of them reached rank 0 through no "
            "collective or send the launcher saw: how did rank 0 learn the other ranks' states?")


# (ranks, backend, the ranks' secrets) -> (the steps the reference printed, its final snapshot, its gradient all-reduces' shapes and
# how many it made): the reference is the exercise as given, bitwise the same every time, so a kernel runs it
# once per world size and backend.
_REFERENCES: dict[tuple[int, str, tuple[int, ...]], tuple[list[int], dict, set[str], int]] = {}


def _all_reduces(collectives, shapes: set[str] | None = None) -> list[str]:
    """The shapes of the all-reduces among `collectives` (those of `shapes` only, when given), in order."""
    found = [str(entry["shapes"]) for entry in collectives if entry["op"] in ALL_REDUCE_OPS]
    return found if shapes is None else [shape for shape in found if shape in shapes]


def _reference(run: RunResult, secrets: list[int]) -> tuple[list[int], dict, set[str], int]:
    """The checker's own run of the exercise as given, without a kill, at `run`'s world size and backend, each
    rank's noise seeded with the secret of `run`'s rank of the same number."""
    from .... import run_script

    key = (run.config.world_size, run.backend, tuple(secrets))  # one agent of world-size ranks: as --nnodes N
    if key not in _REFERENCES:
        # In a folder of its own, removed once read: no script can copy the reference's snapshot as its own.
        scratch = Path(tempfile.mkdtemp(prefix="lesson4-reference-"))
        try:
            reference = run_script(REFERENCE_SCRIPT, nproc=key[0], backend=key[1], stream=False,
                                   timeout_s=max(run.config.timeout_s, 60), run_dir=scratch / "run",
                                   extra_env={"DDP_LESSONS_NOISE_SEEDS": ",".join(map(str, secrets))})
            reference.raise_for_failure()  # the checker's own script: a failure here is not the learner's
            snapshot = _final_snapshot(reference)
            gradient_all_reduces = _all_reduces(records(reference)[0].collectives)  # read before the folder goes
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if snapshot is None:
            raise RuntimeError(f"the exercise's reference run wrote no {SNAPSHOT_NAME}")
        _REFERENCES[key] = (steps_done(reference.ranks[0].stdout), snapshot, set(gradient_all_reduces),
                            len(gradient_all_reduces))
    return _REFERENCES[key]


def _judge_steps(run: RunResult, expected: list[int], report: ExerciseReport, shapes: set[str],
                 all_reduces_per_step: float) -> None:
    """Each step printed once, and the last attempt (the one whose collectives the flight recorder kept)
    made one step's gradient all-reduces per step it printed."""
    attempts = _steps_per_attempt(run)
    done = [step for steps in attempts for step in steps]
    repeated = sorted({step for step in done if done.count(step) > 1})
    lost = sorted(set(expected) - set(done))
    if repeated:
        report.mistakes.append(f"step(s) {repeated} ran twice: before the kill and again after the restart")
    if lost:
        report.mistakes.append(f"step(s) {lost} never ran")
    trained = len(_all_reduces(records(run)[0].collectives, shapes)) / all_reduces_per_step if shapes else None
    if not repeated and not lost and done == expected and trained is not None and round(trained) != len(attempts[-1]):
        report.mistakes.append(
            f"after the restart the ranks printed {len(attempts[-1])} steps but trained {round(trained)} (counted from "
            "DDP's gradient all-reduces, seen by torch's flight recorder): the restart computed steps it did not print")
    elif not repeated and not lost and done == expected:
        before, after = attempts[0], attempts[-1]  # either may be empty: on many ranks a run has few steps
        report.confirmed.append(f"every one of the {len(expected)} steps ran exactly once: "
                                f"{_span(before)} before the kill, {_span(after)} after the restart")


def _steps_per_attempt(run: RunResult) -> list[list[int]]:
    """The steps each attempt printed, read from the rank that printed most in it: the killed rank's last
    line counts even when the others were stopped before printing the same step, and a rank that hides
    lines hides them from itself only."""
    per_rank = [[steps_done(text) for text in rank.attempts] for rank in run.ranks]
    return [max((steps[i] for steps in per_rank if i < len(steps)), key=len)
            for i in range(max(map(len, per_rank)))]


def _span(steps: list[int]) -> str:
    return f"steps {steps[0]}-{steps[-1]}" if steps else "none"


def _final_snapshot(run: RunResult) -> dict | None:
    import torch

    path = run.config.working_dir / SNAPSHOT_NAME
    written = [Path(p) for r in run.ranks for p in records(run)[r.rank].files_written]
    if not path.is_file() or not any(p.name in (SNAPSHOT_NAME, "snapshot.tmp") for p in written):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a torn or foreign file is the learner's to fix
        return None


def _judge_snapshots(mine: dict | None, theirs: dict, report: ExerciseReport) -> None:
    import torch

    if mine is None or "model" not in mine:
        report.mistakes.append(f"no readable {SNAPSHOT_NAME} with the model at the end of the run (keep the "
                               "snapshot rank 0 writes)")
        return
    differences = [(name, (mine["model"][name].float() - value.float()).abs().max().item())
                   for name, value in theirs["model"].items()
                   if name in mine["model"] and (mine["model"][name].shape != value.shape
                                                 or not torch.equal(mine["model"][name].cpu(), value))]
    if set(mine["model"]) != set(theirs["model"]) or differences:
        largest = max((d for _, d in differences), default=float("nan"))
        states = _random_states(mine)
        shared = len(states) >= 2 and all(torch.equal(states[0], state) for state in states[1:])
        ended_right = _noise_ended_as_without_a_kill(states, theirs.get("noise") or [])
        report.mistakes.append(
            f"killed and restarted, the training ended with other weights than the exercise's training without a "
            f"kill (up to {largest:.1e} apart): after the restart the ranks did not go on exactly as they would "
            "have. " + (
                f"The {len(states)} random states in your last snapshot are all the same, so they are not each "
                "rank's own noise stream (each rank's generator is seeded from its own secret): which generator, "
                "and which rank's, does each come from?"
                if shared else
                "Each rank's noise generator ended where it does without a kill (every rank's noise generator is "
                "in the snapshot), so the noise came back; something else a step reads did not."
                if ended_right else
                f"Your snapshot holds {len(states)} random state(s), and none is where a rank's noise generator "
                "ends without a kill: is each saved from the generator the noise is drawn from, and put back into "
                "it on resume?"
                if states else
                "Besides the weights, the optimizer and the step, what else decides what a step after the restart "
                "computes? Read this script's loop line by line."
            ) + " (Keep the model, the data, the noise, the clipping and the seeds as given)"
        )
        return
    report.confirmed.append("the final weights are bitwise those of the exercise's training without a kill")
    expected = _momentum(theirs)
    saved = _momentum(mine)
    if saved is None:
        report.mistakes.append("the snapshot's optimizer has no momentum: save optimizer.state_dict() as given")
    elif len(saved) != len(expected) or not all(a.shape == b.shape and torch.equal(a.cpu(), b)
                                                for a, b in zip(saved, expected)):
        report.mistakes.append("the optimizer's momentum at the end differs from the training without a kill")
    else:
        report.confirmed.append("and so is the optimizer's momentum")


def _random_states(snapshot: dict) -> list:
    """The random states (byte tensors the size of a CPU generator's state, wherever the learner put them) in
    the snapshot, beside the model and the optimizer."""
    import torch

    size = torch.get_rng_state().numel()
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.uint8 and value.numel() == size:
                found.append(value.cpu())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk({key: value for key, value in snapshot.items() if key not in ("model", "optimizer")})
    return found


def _noise_ended_as_without_a_kill(states: list, reference_states: list) -> bool:
    """Whether every rank's noise generator, as it ended in the checker's run without a kill, is among the
    snapshot's random states: the noise was brought back right. (The exercise seeds each rank differently.)"""
    import torch

    return bool(reference_states) and all(any(torch.equal(state, mine) for mine in states)
                                          for state in reference_states)


def _momentum(snapshot: dict) -> list | None:
    state = (snapshot.get("optimizer") or {}).get("state") if isinstance(snapshot.get("optimizer"), dict) else None
    if not state:
        return None
    buffers = [state[key].get("momentum_buffer") for key in sorted(state)]
    return None if any(b is None for b in buffers) else buffers
