"""Exercise checkers: read what the learner's ranks recorded and name each mistake found.

Lesson 2's exercise is a training script that forgets `sampler.set_epoch`, saves on every rank, and
saves the DDP wrapper's state_dict (keys prefixed "module."). The script as given records, on each
rank, the indices seen per epoch (`epoch0_indices`, ...) and `saved_checkpoint` where it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .result import RunResult

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class ExerciseReport:
    """What the checker found. `passed` is True when no mistake was found."""

    mistakes: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mistakes

    def __str__(self) -> str:
        lines = [f"\u2713 {line}" for line in self.confirmed]
        lines += [f"\u2717 {line}" for line in self.mistakes]
        verdict = (
            "All checks pass: the script trains and saves like a DDP script should."
            if self.passed
            else f"{len(self.mistakes)} mistake(s) to fix: edit the exercise cell and run it again."
        )
        return "\n".join([*lines, verdict])

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def check_training_exercise(run: RunResult) -> ExerciseReport:
    """Name each mistake of lesson 2's exercise that the run shows."""
    report = ExerciseReport()
    if not run.ok:
        report.mistakes.append("the run did not finish; fix the error shown above first")
        return report
    _check_epoch_orders(run, report)
    _check_checkpoint_writers(run, report)
    _check_checkpoint_keys(run, report)
    return report


def _check_epoch_orders(run: RunResult, report: ExerciseReport) -> None:
    epochs = sorted(
        (name for name in run.ranks[0].facts if name.startswith("epoch") and name.endswith("_indices")),
        key=lambda name: int(name[len("epoch") : -len("_indices")]),
    )
    if len(epochs) < 2:
        report.mistakes.append("record(f'epoch{epoch}_indices', ...) should run for every epoch (keep those lines)")
        return
    repeating = [r.rank for r in run.ranks if all(r.facts[e] == r.facts[epochs[0]] for e in epochs[1:])]
    if repeating:
        report.mistakes.append(
            f"rank(s) {repeating} saw the same sample order in every epoch: call sampler.set_epoch(epoch) "
            "at the start of each epoch"
        )
    else:
        report.confirmed.append("the sample order changes from epoch to epoch (set_epoch is called)")


def _check_checkpoint_writers(run: RunResult, report: ExerciseReport) -> None:
    writers = [r.rank for r in run.ranks if r.facts.get("saved_checkpoint")]
    if not writers:
        report.mistakes.append("no rank saved a checkpoint: rank 0 should save one")
    elif writers != [0]:
        report.mistakes.append(
            f"rank(s) {writers} wrote the checkpoint: save on rank 0 only (if rank == 0:), then dist.barrier()"
        )
    else:
        report.confirmed.append("only rank 0 wrote the checkpoint")


def _check_checkpoint_keys(run: RunResult, report: ExerciseReport) -> None:
    import torch

    path = run.run_dir / CHECKPOINT_NAME
    if not path.is_file():
        report.mistakes.append(f"no {CHECKPOINT_NAME} was written in the run's folder")
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    wrapped = [key for key in state if key.startswith("module.")]
    if wrapped:
        report.mistakes.append(
            f"the checkpoint's keys start with 'module.' ({wrapped[0]!r}): save model.module.state_dict(), "
            "so the weights load into a plain model"
        )
    else:
        report.confirmed.append("the checkpoint holds the plain model's weights (model.module.state_dict())")
