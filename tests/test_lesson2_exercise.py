"""Lesson 2's exercise: the checker names each mistake of the script as given, passes the solution
shown (hidden) in the notebook, and refuses wrong fixes (made from the solution) for what the ranks did,
not for what the script says. The scripts are taken from the notebook itself."""


import pytest

from ddp_helpers.course.lessons.lesson2 import check_training_exercise
from support import exercise_cells, failure_report, run_on_cpu

def exercise_sources() -> tuple[str, str]:
    _, broken, (solution, *_) = exercise_cells("02_ddp_basics.ipynb")
    return broken, solution.split("\n", 1)[1]  # the solution's cell, without its %%torchrun line


@pytest.fixture(scope="module")
def sources():
    return exercise_sources()


def test_the_given_script_is_judged_wrong_without_naming_its_mistakes_until_asked(write_script, sources):
    """Run All runs the checker on the exercise as given: it must not hand the learner the three mistakes before
    they have looked for them (issue 52), yet the run is judged, and fails."""
    run = run_on_cpu(write_script("exercise", sources[0]), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert not report.passed
    text = str(report)
    assert "made the three mistakes the script is given with" in text and "3 mistakes to fix" in text, text
    for named in ("same order", "each wrote checkpoint.pt", "module.", "set_epoch", "rank 0"):
        assert named not in text, f"the first look names {named!r}:\n{text}"
    text = str(check_training_exercise(run, name_mistakes=True))
    assert "epochs 0 and 1, 0 and 2, 1 and 2 went through the data in the same order" in text
    assert "ranks [0, 1] each wrote checkpoint.pt" in text
    assert "keys start with 'module.'" in text
    assert "3 mistakes to fix" in text
    assert "set_epoch(epoch)" not in text and "model.module.state_dict()" not in text, "hints must not give the fix"


def test_the_solution_passes(write_script, sources):
    run = run_on_cpu(write_script("exercise", sources[1]), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert report.passed, str(report)
    assert "All checks pass" in str(report)


def wrong_fix(solution: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in solution, f"the solution changed: {old!r} not found"
        solution = solution.replace(old, new)
    return solution


SET_EPOCH = "    sampler.set_epoch(epoch)\n    seen = []\n"
RECORD_EPOCH = '    record(f"epoch{epoch}_indices", seen)  # keep: the checker reads it\n'
RANK0_SAVE = 'if rank == 0:\n    torch.save(model.module.state_dict(), "checkpoint.pt")\n'


def test_set_epoch_too_late_and_an_unguarded_save_are_caught(write_script, sources):
    script = wrong_fix(
        sources[1],
        (SET_EPOCH, "    seen = []\n"),
        (RECORD_EPOCH, RECORD_EPOCH + "    sampler.set_epoch(epoch)  # too late: epoch 1 repeats epoch 0\n"),
        # Only the bookkeeping is guarded: every rank still saves.
        (RANK0_SAVE, 'torch.save(model.module.state_dict(), "checkpoint.pt")\n'
                     'if rank == 0:\n    record("saved_checkpoint", True)\n'),
    )
    run = run_on_cpu(write_script("exercise", script), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    text = str(check_training_exercise(run))
    assert "epochs 0 and 1 went through the data in the same order" in text
    assert "ranks [0, 1] each wrote checkpoint.pt" in text
    assert "2 mistakes to fix" in text, text


def test_per_rank_epochs_and_a_torn_checkpoint_from_the_wrong_rank_are_caught(write_script, sources):
    script = wrong_fix(
        sources[1],
        (SET_EPOCH, "    sampler.set_epoch(epoch + rank)  # the ranks now shuffle differently\n    seen = []\n"),
        (RANK0_SAVE, 'if rank == 1:\n    with open("checkpoint.pt", "wb") as f:\n'
                     '        f.write(b"PK\\x03\\x04 cut short")  # a torn file\n'),
    )
    run = run_on_cpu(write_script("exercise", script), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    text = str(report)
    assert "the ranks did not split the data between them: epoch 0:" in text
    assert "rank 1 wrote checkpoint.pt: by convention the rank that logs and saves is rank 0" in text
    assert "checkpoint.pt could not be loaded" in text
    assert "epochs" not in text.split("did not split")[0], "epoch 0 and 1 orders differ here"
    assert len(report.mistakes) == 3, text


def test_a_run_that_crashed_is_reported_as_such(write_script):
    run = run_on_cpu(write_script("crash", "raise RuntimeError('oops')\n"), nproc=2, stream=False)
    report = check_training_exercise(run)
    assert report.mistakes == ["the run did not finish; fix the error shown above first"]


# Wrong fixes that record or save the right shapes without doing the training: the checkpoint is held to the
# weights the checker computes itself from the recorded batches.
@pytest.mark.parametrize("case", ["one rank", "indices recorded, not trained on", "an untrained model saved"])
def test_shortcuts_the_recorded_facts_cannot_hide_are_caught(write_script, sources, case):
    nproc, replacements = 2, []
    if case == "one rank":  # nothing to share and one writer: the unguarded save is never seen
        nproc = 1
        replacements = [(RANK0_SAVE, 'torch.save(model.module.state_dict(), "checkpoint.pt")\n')]
    elif case == "indices recorded, not trained on":  # new orders recorded, epoch 0's trained on every epoch
        replacements = [(SET_EPOCH, "    seen = []\n"),
                        (RECORD_EPOCH, '    record(f"epoch{epoch}_indices", list(DistributedSampler(dataset, seed=epoch)))\n')]
    else:
        replacements = [(RANK0_SAVE, 'if rank == 0:\n    torch.save(torch.nn.Linear(4, 2).state_dict(), "checkpoint.pt")\n')]
    run = run_on_cpu(write_script("exercise", wrong_fix(sources[1], *replacements)), nproc=nproc, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    expected = ("run it on 2 ranks or more" if case == "one rank"
                else "the checkpoint's weights are not those the exercise's model, data and optimizer reach")
    assert len(report.mistakes) == 1 and expected in report.mistakes[0], str(report)


# Every recorded fact and the checkpoint right, without any training across ranks: the orders each rank's
# sampler would give, and the checker's own reference weights saved by rank 0, with no process group.
WITHOUT_TRAINING = """
import os
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from ddp_helpers import record
from ddp_helpers import rank_secret
from ddp_helpers.course.lessons.lesson2 import trained_on

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dataset, orders = TensorDataset(torch.arange(64)), {}
for epoch in range(3):
    orders[epoch] = []
    for r in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=r, seed=0)
        sampler.set_epoch(epoch)
        orders[epoch].append(list(sampler))
    record(f"epoch{epoch}_indices", orders[epoch][rank])
if rank == 0:
    torch.save(trained_on(orders, [rank_secret()] * world), "checkpoint.pt")  # the others' secrets are theirs
"""


def test_the_right_facts_and_weights_without_the_ranks_training_together_are_caught(write_script):
    run = run_on_cpu(write_script("exercise", WITHOUT_TRAINING), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert len(report.mistakes) == 1 and "not every rank averaged its gradients with the others in each of the 12 " \
        "steps" in report.mistakes[0], str(report)


def test_an_all_reduce_for_show_beside_training_alone_is_caught(write_script, sources):
    """No DDP: each rank trains alone on its own batches, and all-reduces one number per step for show."""
    alone = sources[1].replace(
        'model = DDP(torch.nn.Linear(4, 2).to(device), device_ids=[local_rank] if device.type == "cuda" else None)',
        "model = torch.nn.Linear(4, 2).to(device)").replace(
        "        optimizer.step()\n", "        dist.all_reduce(torch.zeros(1))\n        optimizer.step()\n").replace(
        "model.module.state_dict()", "model.state_dict()")
    assert alone.count("all_reduce(torch.zeros(1))") == 1 and "DDP(" not in alone
    run = run_on_cpu(write_script("exercise", alone), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert "less than a gradient's 10 values per step" in str(report), str(report)


# The secrets passed over a raw socket, which the launcher does not watch: every rank trains through DDP on the
# whole global batch (each rank's share jittered with that rank's secret), so its gradient is already the average
# and the checkpoint is right; each rank still records its own share and jitters its own batch.
GLOBAL_BATCH_FROM_A_SOCKET = """
from ddp_helpers import rank_secret
from ddp_helpers.course.lessons.lesson2 import augment
secrets, world = exchanged(rank_secret()), dist.get_world_size()
for epoch in range(3):
    samplers = [DistributedSampler(dataset, num_replicas=world, rank=r, seed=0) for r in range(world)]
    for each in samplers:
        each.set_epoch(epoch)
    seen = []
    for batches in zip(*[DataLoader(dataset, batch_size=8, sampler=each) for each in samplers]):
        seen += batches[rank][0].tolist()
        my_augmentation(batches[rank][1], batches[rank][0])
        inputs = torch.cat([augment(inputs, index, secrets[r]) for r, (index, inputs, _) in enumerate(batches)])
        targets = torch.cat([targets for _, _, targets in batches])
        loss = torch.nn.functional.cross_entropy(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    record(f"epoch{epoch}_indices", seen)  # keep: the checker reads it
"""


def test_the_others_batches_learned_over_a_raw_socket_are_judged_wrong_for_want_of_evidence(write_script, sources):
    from support import SOCKET_EXCHANGE, free_port

    head, tail = sources[1].split("for epoch in range(3):")
    script = SOCKET_EXCHANGE + head + GLOBAL_BATCH_FROM_A_SOCKET + tail[tail.index("\nif rank == 0:"):]
    run = run_on_cpu(write_script("exercise", script), nproc=2, stream=False, extra_env={"SIDE_PORT": str(free_port())})
    assert run.ok, failure_report(run)
    report = check_training_exercise(run)
    assert "the checkpoint holds the weights" in str(report), "the weights were right: only the road was wrong"
    assert len(report.mistakes) == 1 and "no all-reduce the launcher saw carried rank" in report.mistakes[0], str(report)
