"""Lesson 2 (DDP basics): the exercise checker. It judges what the learner's ranks did, and names each
mistake found.

Lesson 2's exercise is a training script that forgets `sampler.set_epoch`, saves on every rank, and
saves the DDP wrapper's state_dict (keys prefixed "module."). The checker trusts nothing the script
says about itself beyond the indices each rank's DataLoader gave it (`epoch0_indices`, ...), and those
are held to the checkpoint:
- the run has at least 2 ranks (on one, nothing about sharing the data or saving once can go wrong);
- every epoch's order differs from every other epoch's;
- every rank all-reduced a gradient's worth of values in every step it recorded (torch's flight recorder):
  rank 0 training alone on every rank's batches, or no process group at all, does not pass;
- in every epoch the ranks' shares are disjoint and cover the data set (up to DistributedSampler's padding);
- who wrote the checkpoint is observed by the launcher (`records.RankRecords.files_written`), not reported;
- the checkpoint is loaded and must load into a plain, unwrapped model; a torn or unreadable file is named;
- its weights are those the exercise's own model, data and optimizer reach, computed here, when each step
  averages over the ranks the batches they recorded: a checkpoint of another model (an untrained one), or
  indices recorded but not trained on, do not match. Each rank jitters its batches with noise drawn from
  its secret (`my_augmentation`; `ddp_helpers.rank_secret`), as data augmentation draws from each rank's
  own generator: no rank can compute another's gradients, so the ranks must train together.
Hints name the mistake found without handing out the fix. On a run that makes exactly the three mistakes the
script is given with (the exercise not yet tried), the checker says so and names none of them: finding them is the
exercise. It names them once one is fixed, or when asked (`name_mistakes=True`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from ...exercises import ExerciseReport, all_reduced_values, own_gradients_unseen, opening
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

CHECKPOINT_NAME = "checkpoint.pt"
DATASET_SIZE = 64  # the exercise's TensorDataset
BATCH_SIZE = 8  # per rank


AUGMENTATION = 0.1  # the scale of each sample's random jitter


def _exercise_model():
    import torch

    return torch.nn.Linear(4, 2)


def augment(inputs, indices, secret: int):
    """`inputs` (samples `indices`) with the random jitter the rank whose secret is `secret` draws for them:
    each sample's own, from the secret and the sample's index, so that the checker can draw it again."""
    import torch

    noise = torch.stack([torch.randn(inputs.shape[1:], generator=torch.Generator().manual_seed((secret + int(i)) % 2**63))
                         for i in indices])
    return inputs + AUGMENTATION * noise.to(inputs.device, inputs.dtype)


def my_augmentation(inputs, indices):
    """In a rank: `inputs` randomly jittered as data augmentation does, from the secret only this rank's
    process is handed (`ddp_helpers.rank_secret`): another rank cannot compute this rank's batch. From its first
    call the launcher logs what the rank's DDP model hands DDP's all-reduces, the evidence the checker asks for."""
    from ... import _all_reduce_log

    _all_reduce_log.log_ddp_gradients()
    return augment(inputs, indices, rank_secret())


#: how each of the three mistakes the exercise is given with shows in the checker's report
AS_GIVEN = ("went through the data in the same order on every rank", "each wrote " + CHECKPOINT_NAME,
            "keys start with 'module.'")


@records_progress  # the learner's progress notes whether this run passed
def check_training_exercise(run: RunResult, name_mistakes: bool = False) -> ExerciseReport:
    """Name each mistake of lesson 2's exercise that the run shows; on a run that makes just the three the exercise
    is given with, say so without naming them, unless `name_mistakes`."""
    report = ExerciseReport()
    # The files written are judged below: who saved.
    secrets = opening(run, report, ranks_for="one rank has no other to average its gradients with", files=False)
    if secrets is None:
        return report
    orders = _epoch_orders(run)
    orders_fine = _check_epochs(orders, len(run.ranks), report)
    averaged = orders_fine and _check_gradients_averaged(run, orders, report)
    path = _check_checkpoint_writers(run, report)
    if path is not None:
        state = _check_checkpoint_contents(path, report)
        if state is not None and averaged:  # weights of ranks that never trained together would only repeat that
            _check_trained_weights(state, orders, secrets, report, run)
    if not name_mistakes and len(report.mistakes) == len(AS_GIVEN) and all(
            any(sign in mistake for mistake in report.mistakes) for sign in AS_GIVEN):
        report.withheld = (
            "your run made the three mistakes the script is given with. Find them in the script before the checker "
            "names them: each is one of this lesson's steps done wrong or left out. Once one is fixed, run both "
            "cells again and the checker names each mistake still there (stuck? "
            "check_training_exercise(exercise, name_mistakes=True) names them now)")
    return report


def _epoch_orders(run: RunResult) -> dict[int, list[list[int]]] | None:
    """{epoch: [rank 0's indices, rank 1's, ...]}, or None when a rank did not record every epoch."""
    names = {name for r in run.ranks for name in r.facts if re.fullmatch(r"epoch\d+_indices", name)}
    epochs = sorted(int(name[len("epoch"):-len("_indices")]) for name in names)
    if any(f"epoch{e}_indices" not in r.facts for e in epochs for r in run.ranks):
        return None
    return {e: [list(r.facts[f"epoch{e}_indices"]) for r in run.ranks] for e in epochs}


def _check_epochs(orders: dict[int, list[list[int]]] | None, world: int, report: ExerciseReport) -> bool:
    """Whether the recorded orders are fine (new in every epoch, shared between the ranks)."""
    if orders is None or len(orders) < 2:
        report.mistakes.append("record(f'epoch{epoch}_indices', ...) should run on every rank for every epoch "
                               "(keep those lines)")
        return False
    epochs = sorted(orders)
    repeated = [(a, b) for i, a in enumerate(epochs) for b in epochs[i + 1:] if orders[a] == orders[b]]
    if repeated:
        pairs = ", ".join(f"{a} and {b}" for a, b in repeated)
        report.mistakes.append(
            f"epochs {pairs} went through the data in the same order on every rank: the sampler was not told "
            "which epoch each one is, in time for it"
        )
    else:
        report.confirmed.append("every epoch went through the data in a new order")

    overlaps = []
    for epoch in epochs:
        problem = _share_problem(orders[epoch], world)
        if problem:
            overlaps.append(f"epoch {epoch}: {problem}")
    if overlaps:
        report.mistakes.append(
            "the ranks did not split the data between them: " + "; ".join(overlaps)
            + ". Every rank's sampler must shuffle the same way for the shares to fit together"
        )
    else:
        report.confirmed.append(f"in every epoch the {world} ranks' shares were disjoint and covered the data set")
    return not repeated and not overlaps


def _check_gradients_averaged(run: RunResult, orders: dict[int, list[list[int]]], report: ExerciseReport) -> bool:
    """Every rank all-reduced gradients in every step it recorded (DDP's backward), as torch's flight recorder
    saw it: training on one rank and recording the others' batches, or no process group at all, does not."""
    steps = sum(math.ceil(max(len(share) for share in orders[epoch]) / BATCH_SIZE) for epoch in orders)
    parameters = sum(p.numel() for p in _exercise_model().parameters())
    # Values, not calls: an all-reduce of one number per step for show is not a gradient's worth.
    values = {r.rank: all_reduced_values(records(run)[r.rank].collectives) for r in run.ranks}
    short = {rank: count for rank, count in values.items() if count < steps * parameters}
    if short:
        report.mistakes.append(
            f"not every rank averaged its gradients with the others in each of the {steps} steps: torch's flight "
            f"recorder saw all-reduces of " + ", ".join(f"{count} values on rank {rank}" for rank, count in short.items())
            + f", less than a gradient's {parameters} values per step. Keep the DDP wrap, and train on every rank")
        return False
    report.confirmed.append(f"every rank all-reduced its gradients in each of the {steps} steps (DDP's "
                            "backward, seen by torch's flight recorder)")
    return True


def _share_problem(shares: list[list[int]], world: int) -> str | None:
    """What is wrong with one epoch's shares, or None. DistributedSampler pads with repeats (or, with
    drop_last=True, leaves out the remainder): that much is allowed."""
    counts = Counter(index for share in shares for index in share)
    outside = [i for i in counts if not 0 <= i < DATASET_SIZE]
    seen_twice = sum(c - 1 for c in counts.values())
    unseen = DATASET_SIZE - len(counts) + len(outside)
    padding = math.ceil(DATASET_SIZE / world) * world - DATASET_SIZE
    dropped = DATASET_SIZE - (DATASET_SIZE // world) * world
    if not outside and ((unseen == 0 and seen_twice <= padding) or (seen_twice == 0 and unseen <= dropped)):
        return None
    return f"{seen_twice} sample(s) seen by more than one rank, {unseen} by none"


def _check_checkpoint_writers(run: RunResult, report: ExerciseReport) -> Path | None:
    written = {r.rank: [p for p in records(run)[r.rank].files_written if Path(p).name == CHECKPOINT_NAME] for r in run.ranks}
    writers = [rank for rank, paths in written.items() if paths]
    if not writers:
        report.mistakes.append(f"no rank wrote {CHECKPOINT_NAME}: the trained model is lost when the job ends")
        return None
    if len(writers) > 1:
        report.mistakes.append(
            f"ranks {writers} each wrote {CHECKPOINT_NAME}: several processes writing one file race each other "
            "(and can leave it torn), for weights that are identical anyway"
        )
    elif writers != [0]:
        report.mistakes.append(
            f"rank {writers[0]} wrote {CHECKPOINT_NAME}: by convention the rank that logs and saves is rank 0"
        )
    else:
        report.confirmed.append(f"only rank 0 wrote {CHECKPOINT_NAME} (seen by the launcher)")
    return Path(written[writers[0]][-1])


def _check_checkpoint_contents(path: Path, report: ExerciseReport) -> dict | None:
    """The checkpoint's state_dict when it loads into the plain model, else None (the mistake named)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a torn or foreign file is the learner's to fix, not a crash
        first_line = (str(error).splitlines() or [""])[0][:160]
        report.mistakes.append(
            f"{path.name} could not be loaded ({type(error).__name__}: {first_line}): it is torn, or holds "
            "something other than a state_dict of tensors"
        )
        return None
    if not isinstance(state, dict):
        report.mistakes.append(f"{path.name} holds a {type(state).__name__}, not a state_dict")
        return None
    wrapped = [key for key in state if isinstance(key, str) and key.startswith("module.")]
    if wrapped:
        report.mistakes.append(
            f"the checkpoint's keys start with 'module.' ({wrapped[0]!r}): they are the DDP wrapper's names, so "
            "the weights will not load into a plain, unwrapped model"
        )
        return None
    try:
        _exercise_model().load_state_dict(state)
    except Exception as error:  # noqa: BLE001
        report.mistakes.append(f"the checkpoint does not load into the plain model ({type(error).__name__})")
        return None
    report.confirmed.append("the checkpoint loads into a plain, unwrapped model")
    return state


def trained_on(orders: dict[int, list[list[int]]], secrets: list[int]):
    """The exercise's model (its seed, data, SGD at lr 0.1) trained here in one process as DDP trains it:
    each step, every rank's next batch of 8 from the indices it recorded, jittered as that rank's secret
    jitters it, the gradients averaged over the ranks. Returns the trained state_dict."""
    return _training(orders, secrets)[0]


def _training(orders: dict[int, list[list[int]]], secrets: list[int]):
    """(`trained_on`'s state_dict, and per step, per rank, that rank's own gradient on the way)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(DATASET_SIZE, 4, generator=generator)
    labels = (features.sum(dim=1) > 0).long()
    torch.manual_seed(0)
    model = _exercise_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own_gradients = []
    for epoch in sorted(orders):
        shares = orders[epoch]
        for start in range(0, max(len(share) for share in shares), BATCH_SIZE):
            optimizer.zero_grad()
            grads = []
            for share, secret in zip(shares, secrets):
                batch = torch.tensor(share[start:start + BATCH_SIZE])
                model.zero_grad()
                inputs = augment(features[batch], batch, secret)
                torch.nn.functional.cross_entropy(model(inputs), labels[batch]).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            own_gradients.append(grads)
            for p, *per_rank in zip(model.parameters(), *grads):
                p.grad = sum(per_rank) / len(per_rank)
            optimizer.step()
    return model.state_dict(), own_gradients


def _check_trained_weights(state: dict, orders: dict[int, list[list[int]]], secrets: list[int],
                           report: ExerciseReport, run: RunResult) -> None:
    import torch

    expected, own_gradients = _training(orders, secrets)
    if all(torch.allclose(state[name].float(), value, atol=1e-5, rtol=1e-4) for name, value in expected.items()):
        report.confirmed.append(
            f"the checkpoint holds the weights the exercise's model reaches on the batches your ranks recorded "
            f"({len(orders)} epochs, gradients averaged over the ranks; computed here in one process)")
        unseen = own_gradients_unseen(run, own_gradients)
        if unseen:
            report.mistakes.append(
                "the weights are right, but no all-reduce the launcher saw carried "
                + "; ".join(f"rank {r}'s own gradient at step {steps[0]}" for r, steps in unseen.items())
                + ": the ranks learned each other's batches some other way. What do DDP's all-reduces carry?")
    else:
        report.mistakes.append(
            "the checkpoint's weights are not those the exercise's model, data and optimizer reach on the batches "
            "your ranks recorded (computed here in one process): the file holds another model, or the ranks "
            "trained on other batches than they recorded")
