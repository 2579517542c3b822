"""What an exercise checker hands back (`ExerciseReport`, the mistakes it found and what it confirmed), and
what several checkers share: reading the ranks' secrets, naming side channels, the regression exercises'
teacher and one-process reference training, a distance between weights, a second run at another world size.
Each lesson's checker lives with the lesson (`ddp_helpers/course/lessons/`)."""

from __future__ import annotations

import functools
import html
import math
import os
from dataclasses import dataclass, field
from .records import records


@dataclass
class ExerciseReport:
    """What the checker found. `passed` is True when no mistake was found."""

    mistakes: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    verdict_when_passed: str = "All checks pass: the script trains and saves like a DDP script should."
    # Said in place of the mistakes, which stay unnamed (a checker's first look at the exercise as given: the
    # learner looks for them first). The mistakes still count: the report has not passed.
    withheld: str = ""
    # The learner's progress in the lesson, said after the verdict (`progress.records_progress` fills it in).
    progress: str = ""

    @property
    def passed(self) -> bool:
        return not self.mistakes

    def __str__(self) -> str:
        lines = [f"\u2713 {_sentence(line)}" for line in self.confirmed]
        lines += [f"\u2717 {_sentence(line)}" for line in ([self.withheld] if self.withheld else self.mistakes)]
        count = len(self.mistakes)
        verdict = (
            self.verdict_when_passed
            if self.passed
            else f"{count} mistake{'s' if count > 1 else ''} to fix: edit the exercise cell and run it again."
        )
        return "\n".join([*lines, verdict, *([self.progress] if self.progress else [])])

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        # In JupyterLab: one paragraph per finding, wrapped at word boundaries (a text output is broken
        # wherever the panel ends, in the middle of words); text/plain stays for everything else.
        lines = "".join(f"<div style='margin: 0.2em 0'>{html.escape(line)}</div>" for line in str(self).splitlines())
        return f"<div class='ddp-lessons-exercise-report'>{lines}</div>"


FAILED = "the run did not finish; fix the error shown above first"
TIMED_OUT = "the run did not finish within its --timeout; the report above says where each rank was: fix that first"


def opening(run, report: ExerciseReport, *, ranks_for: str, exactly: int | None = None, at_least: int = 2,
            facts: tuple[str, ...] = (), facts_hint: str | None = None, files: bool = True,
            channels: bool = True) -> list[int] | None:
    """What every exercise checker asks of a run before judging what the exercise is about, in this order: the run
    ended well; it ran on the ranks the exercise needs (`exactly`, or `at_least`; `ranks_for`: why, for the hint);
    every rank recorded the `facts` the checker reads (`facts_hint`: the mistake to name when not, if the generic
    "keep the record(...) line" does not say it); every rank's secret can be read and no rank went into other
    ranks' files (`rank_secrets`); nothing passed around the collectives (`side_channels`, with `files`: files the
    ranks wrote count, unless writing files is the exercise; `channels=False`: judged later, by the checker).
    Returns the ranks' secrets, or None with the first mistake added to `report`: the checker judges no further."""
    if not run.ok:
        report.mistakes.append(TIMED_OUT if run.timed_out else FAILED)
        return None
    world = len(run.ranks)
    if exactly is not None and world != exactly:
        report.mistakes.append(f"run it on {exactly} ranks (-n {exactly}), not {world}: {ranks_for}")
        return None
    if exactly is None and world < at_least:
        report.mistakes.append(f"run it on {at_least} ranks or more (it ran on {world}): {ranks_for}")
        return None
    missing = [name for name in facts if any(name not in r.facts or name in r.unreadable_facts for r in run.ranks)]
    if missing and facts_hint:
        report.mistakes.append(facts_hint)
        return None
    if missing:
        lines = " and ".join(f"record({name!r}, ...)" for name in missing)
        report.mistakes.append(f"keep the {lines} line{'s' if len(missing) > 1 else ''}: the checker reads "
                               f"{'them' if len(missing) > 1 else 'it'} on every rank")
        return None
    secrets = rank_secrets(run, report)
    if secrets is None:
        return None
    around = side_channels(run, files=files) if channels else None
    if around:
        report.mistakes.append(around)
        return None
    return secrets


def recorder_lost(run) -> list[int]:
    """The ranks whose flight recorder holds no collective, or no longer holds their first ones (it keeps the last
    TORCH_FR_BUFFER_SIZE, 2000 by default): each group's sequence numbers start at 1, so a first kept entry above 1
    means lost ones. A checker that counts collectives cannot count from a partial record."""
    lost = []
    for seen in records(run):
        first = {}
        for entry in seen.collectives:
            first.setdefault(entry.get("group"), entry.get("number", 1))
        if not seen.collectives or any(number != 1 for number in first.values()):
            lost.append(seen.rank)
    return lost


def rank_secrets(run, report: ExerciseReport) -> list[int] | None:
    """Every rank's secret (`ddp_helpers.rank_secret`, which its exercise data comes from) from the run folder;
    None, with the mistake added to `report`, where one cannot be read, or where a rank's script went into
    other ranks' files there or changed its own secret (`records.RankRecords.crossings`): every exercise checker starts
    here, so none judges such a run further."""
    crossed = [f"rank {seen.rank} {_listed(seen.crossings)}" for seen in records(run) if seen.crossings]
    if crossed:
        report.mistakes.append(
            f"{'; '.join(crossed)} in the run folder. Those files are the launcher's record of the run, not the "
            "ranks' data: a real job has none, each rank's data lives in its own process. How else can a rank "
            "learn what another holds?")
        return None
    secrets = [seen.secret for seen in records(run)]
    if run.ranks and all(secret is None for secret in secrets):  # none drawn: the course's rank hook was off
        report.mistakes.append(
            "this run kept none of the records the checker judges a run by: run the notebook's first cell "
            "(`%load_ext ddp_helpers.course`), then the exercise's cell again")
        return None
    if None in secrets:
        report.mistakes.append("the checker could not read every rank's secret from the run folder; run the cell again")
        return None
    return secrets


def _listed(crossings) -> str:
    """The crossings as one phrase: one verb for each run of crossings with the same verb, the names joined."""
    groups: list[tuple[str, list[str]]] = []
    for crossing in crossings:
        how, _, name = crossing.rpartition(" ")
        if groups and groups[-1][0] == how:
            groups[-1][1].append(name)
        else:
            groups.append((how, [name]))
    return ", ".join(f"{how} {' and '.join(names) if len(names) < 3 else ', '.join(names[:-1]) + ' and ' + names[-1]}"
                     for how, names in groups)


def side_channels(run, *, files: bool = True) -> str | None:
    """A mistake naming what the ranks passed around torch's collectives, or None: bytes through a key-value
    store (`records.RankRecords.channel_bytes`, counted at torch's Store class, whichever store the script held) and,
    with `files`, the files they wrote. A checker judges what collectives moved; it cannot see or count what
    crossed another way, so that does not pass."""
    found = []
    for seen in records(run):
        calls, size = seen.channel_bytes.get("store_calls", 0), seen.channel_bytes.get("store_bytes", 0)
        where = [f"{calls} key-value store call{'s' if calls != 1 else ''}, {size:,} bytes"] if calls else []
        if files and seen.files_written:
            where.append("wrote " + ", ".join(seen.files_written[:3]) + (" ..." if len(seen.files_written) > 3 else ""))
        if where:
            found.append(f"rank {seen.rank}: {'; '.join(where)}")
    if not found:
        return None
    return (f"the ranks passed data around the collectives ({'; '.join(found)}): a store is for finding each other, "
            "and in a real job the ranks may not share a file system. The exercise is judged on what the ranks' "
            "collectives moved, which the checker can see")


def all_reduced_values(collectives, ops: tuple[str, ...] | None = None) -> int:
    """How many values a rank all-reduced (the elements of every all_reduce's tensors), from what the
    flight recorder saw, DDP's bucket all-reduces included: a count the script cannot fake by what it records."""
    from math import prod

    from ..flight_recorder import ALL_REDUCE_OPS

    return sum(prod(shape) for call in collectives if call["op"] in (ops or ALL_REDUCE_OPS)
               for shape in call["shapes"])


@functools.cache  # one teacher for every batch: it is fixed by its seed
def regression_teacher(inputs: int):
    """The small network whose outputs are the regression exercises' targets (lessons 6 and 7), the same
    in every rank and in the checker: seeded, `inputs` wide."""
    import torch

    generator = torch.Generator().manual_seed(1)
    teacher = torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return teacher


def train_on_every_share(model, shares_of_step, steps: int, learning_rate: float) -> list:
    """A checker's reference, in one process: `steps` steps of SGD on the mean squared error over every rank's
    share of each step's batch, `shares_of_step(step)` -> [(inputs, targets), ...] (shares of equal size: the
    mean over all of them is what DDP's average computes). Returns the final weights."""
    import torch

    if "TORCHELASTIC_RUN_ID" in os.environ:  # inside a rank: recording these weights would skip the exercise
        raise RuntimeError("exercise_reference is the checker's answer, computed in the notebook: the exercise's "
                           "script must train the model itself")
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    for step in range(steps):
        shares = shares_of_step(step)
        inputs, targets = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def per_share_gradients(model, optimizer, shares_of_step, steps: int, loss, fingerprint) -> tuple[list, list]:
    """Train `model` as `train_on_every_share` does (each step on every share at once, `loss(outputs, targets)`),
    and on the way take `fingerprint(parameters)` of the gradients of each share's loss alone and of the whole
    step's: ([per step, per share], [per step]). What each rank's own data hands the collectives, along the
    intended training, for the checkers' positive evidence."""
    import torch

    per_share, whole = [], []
    for step in range(steps):
        shares = shares_of_step(step)
        per_share.append([])
        for inputs, targets in shares:
            model.zero_grad()
            loss(model(inputs), targets).backward()
            per_share[-1].append(fingerprint(list(model.parameters())))
        optimizer.zero_grad()
        loss(model(torch.cat([s[0] for s in shares])), torch.cat([s[1] for s in shares])).backward()
        whole.append(fingerprint(list(model.parameters())))
        optimizer.step()
    return per_share, whole


def distance(weights, others) -> float:
    """The Euclidean distance between two lists of tensors, taken as one vector."""
    return math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(weights, others)))


def run_again(run, nproc: int, timeout_s: float):
    """The run's script launched again by a checker on `nproc` CPU ranks (gloo, whatever the machine has), in a
    run folder beside the first one's."""
    from .. import run_script

    return run_script(run.config.script, nproc=nproc, backend="gloo", stream=False, timeout_s=timeout_s,
                      run_dir=run.run_dir.with_name(f"{run.run_dir.name}-at-{nproc}"))


def _sentence(finding: str) -> str:
    """A finding ends as a sentence does, whether its checker wrote the final full stop or not."""
    finding = finding.rstrip()
    return finding if finding.endswith((".", "?", "!")) else finding + "."


def own_gradients_unseen(run, own_gradients: list) -> dict[int, list[int]]:
    """Per rank, the steps at which the launcher saw no collective carry the rank's own gradient (`own_gradients`:
    per step, per rank, a tensor per parameter; each parameter's, or its share: divided by the world size), through
    dist.all_reduce or DDP's buckets (what a DDP model handed them: `_all_reduce_log.log_ddp_gradients`, which the
    exercise's rank-side helper turns on). Positive evidence, whatever road the other ranks' data could take
    besides: a checker asks for it rather than listing the cheats it knows."""
    world = len(run.ranks)
    unseen = {}
    for rank in run.ranks:
        handed = [call["values"] for call in records(run)[rank.rank].handed_to_collectives
                  if call.get("collective") in ("all_reduce", "ddp") and "values" in call]
        missing = []
        for step, per_rank in enumerate(own_gradients):
            for gradient in per_rank[rank.rank]:
                wanted = gradient.flatten().double().tolist()
                if not any(_carries(values, wanted, scale) for values in handed for scale in (1.0, 1.0 / world)):
                    missing.append(step)
                    break
        if missing:
            unseen[rank.rank] = missing
    return unseen


def _carries(values: list[float], wanted: list[float], scale: float) -> bool:
    """Whether `values` holds `wanted` × `scale`, whole or as a contiguous part (a flattened concatenation)."""
    size = len(wanted)
    for start in range(len(values) - size + 1):
        if all(abs(values[start + i] - w * scale) <= 1e-5 * max(1.0, abs(w)) for i, w in enumerate(wanted)):
            return True
    return False
