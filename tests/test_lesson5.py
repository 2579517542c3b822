"""Lesson 5's exercise (a training run that hangs at a step that looks random): the given script hangs
and the checker says where; the solution passes; fixes that only hide the hang, or change the training,
do not."""


import pytest

from ddp_helpers.lessons.lesson5 import check_hang_exercise, exercise_reference, skipped_steps
from support import exercise_cells, failure_report, run_on_cpu

pytestmark = pytest.mark.usefixtures("warm_launches")  # the hanging runs are timed from a warm start
SKIP = "    if not keep.any():\n        continue  # nothing left to learn from on this rank\n"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, *_) = exercise_cells("05_when_things_go_wrong.ipynb")
    solution = solution.split("\n", 1)[1]  # the solution's cell, without its %%torchrun line
    assert SKIP in given
    return given, solution


def test_the_given_data_leaves_a_rank_an_empty_batch_mid_run():
    # What makes the exercise hang at a step that looks random: rank 0's batch is all outliers at step 8.
    assert skipped_steps(2)[0] and 0 < min(skipped_steps(2)[0]) < 15


def judged(write_script, source: str, timeout_s: float = 60):
    run = run_on_cpu(write_script("exercise", source), timeout_s=timeout_s, stream=False)
    return run, check_hang_exercise(run)


def test_the_given_script_hangs_and_the_checker_names_the_collectives_that_disagree(write_script, sources):
    run, report = judged(write_script, sources[0], timeout_s=8)
    assert run.timed_out and not report.passed, failure_report(run)
    assert "the run hangs. The ranks disagree at collective #" in str(report), str(report)


def test_the_solution_passes(write_script, sources):
    run, report = judged(write_script, sources[1])
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"


# The intended training without a collective: each rank reads every rank's shard and averages by itself.
EVERY_RANK_ALONE = """from ddp_helpers.lessons.lesson5 import rank_batches
shards = [rank_batches(r) for r in range(world_size)]
done = []
for step in range(STEPS):
    total = [torch.zeros_like(p) for p in model.parameters()]
    for shard in shards:
        inputs, targets, keep = next(shard)
        if keep.any():
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep]).backward()
            for sum_, p in zip(total, model.parameters()):
                sum_ += p.grad
    for sum_, p in zip(total, model.parameters()):
        p.grad = sum_ / world_size
    optimizer.step()
    done.append(step)
dist.barrier()
record("steps", done)
record("weights", [p.detach().cpu() for p in model.parameters()])
dist.destroy_process_group()
"""

WRONG_FIXES = {
    # Hides nothing: the skipping rank still runs fewer all-reduces, so the run still ends stuck.
    "a longer timeout": (lambda s: s.replace("timeout=timedelta(seconds=30)", "timeout=timedelta(seconds=600)"),
                         "the run hangs"),
    "a barrier in the skipping branch": (lambda s: s.replace(SKIP, SKIP.replace("        continue", "        dist.barrier()\n        continue")),
                                         "the run hangs"),
    "the all-reduces removed on every rank": (
        lambda s: s.replace("    if not keep.any():\n        continue", "    if not keep.any():\n        keep[:] = True")
                   .replace("        dist.all_reduce(p.grad)\n", ""),
        "too few all-reduces"),
    "every rank skips the step when one has nothing": (
        lambda s: s.replace(SKIP, "    empty = torch.tensor(float(not keep.any()), device=device)\n"
                                  "    dist.all_reduce(empty)\n    if empty.item() > 0:\n        continue\n"),
        "not every rank took part in every step"),
    "the outliers kept": (lambda s: s.replace("< OUTLIER", "< 100.0"), "not those of the intended training"),
    # Shortcuts that record the right numbers without the ranks training together.
    "the checker's reference recorded": (
        lambda s: s.split("done = []")[0] + "from ddp_helpers.lessons.lesson5 import exercise_reference\n"
                  "done = list(range(STEPS))\ndist.barrier()\nrecord('steps', done)\n"
                  "record('weights', exercise_reference(world_size))\ndist.destroy_process_group()\n",
        "the run failed"),
    "every rank computes every rank's gradient itself": (lambda s: s.split("done = []")[0] + EVERY_RANK_ALONE, "too few all-reduces"),
    # The same, with the given all-reduces kept for show: they reduce the average every rank computed alike.
    "every rank computes every rank's gradient, then all-reduces the average": (
        lambda s: s.split("done = []")[0] + EVERY_RANK_ALONE.replace(
            "        p.grad = sum_ / world_size\n",
            "        p.grad = sum_ / world_size\n        dist.all_reduce(p.grad)\n        p.grad /= world_size\n"),
        "not every rank all-reduced its own gradient"),
    # The reference's weights typed in, and all-reduces of zeros in the numbers a real training would make.
    "the reference's numbers typed in, beside all-reduces of zeros": (
        lambda s: s.split("done = []")[0] + "for step in range(STEPS):\n    for p in model.parameters():\n"
                  "        dist.all_reduce(torch.zeros_like(p))\n"
                  f"record('steps', list(range(STEPS)))\nrecord('weights', {_typed_in_reference()})\n"
                  "dist.destroy_process_group()\n",
        "not every rank all-reduced its own gradient"),
    "no weights recorded": (lambda s: _solution().replace('record("weights", [p.detach().cpu() for p in model.parameters()])',
                                                          'record("weights", [])'),
                            "record('weights', ...) as given"),
}


def _typed_in_reference() -> str:
    return "[" + ", ".join(f"torch.tensor({p.tolist()!r})" for p in exercise_reference(2)) + "]"


def _solution() -> str:
    _, _, (solution, *_) = exercise_cells("05_when_things_go_wrong.ipynb")
    return solution.split("\n", 1)[1]


@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_a_wrong_fix_does_not_pass(write_script, sources, name):
    change, named = WRONG_FIXES[name]
    wrong = change(sources[0])
    assert wrong not in sources
    run, report = judged(write_script, wrong, timeout_s=8)
    assert not report.passed and named in str(report), f"{report}\n{failure_report(run)}"


def test_the_reference_is_the_intended_training_and_differs_from_the_shortcuts():
    import torch

    two, four = exercise_reference(2), exercise_reference(4)
    assert not all(torch.equal(a, b) for a, b in zip(two, four)), "the world size changes the data seen"
    assert all(torch.isfinite(p).all() for p in two)


def test_one_rank_is_not_enough(write_script, sources):
    # On one rank nothing can hang, and a skipped step costs nothing with plain SGD: no evidence of a fix.
    run = run_on_cpu(write_script("exercise", sources[1]), nproc=1, stream=False)
    report = check_hang_exercise(run)
    assert not report.passed and "run it on 2 ranks or more" in str(report), f"{report}\n{failure_report(run)}"


def test_py_spy_refused_by_ptrace_is_reported_not_raised(tmp_path, monkeypatch):
    # Ubuntu's default (Yama ptrace_scope 1): py-spy, not the ranks' ancestor, may not read them.
    from ddp_helpers.lessons.lesson5 import py_spy_dump

    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Operation not permitted (os error 1)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert py_spy_dump(1, until="never") == (False, "Error: Operation not permitted (os error 1)")


def test_a_py_spy_sample_that_fails_midway_is_taken_again(tmp_path, monkeypatch):
    # py-spy reads a live process: a sample can fail while the process changes its frames (seen in CI).
    from ddp_helpers.lessons.lesson5 import py_spy_dump

    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\nif [ ! -e {tmp_path}/tried ]; then touch {tmp_path}/tried\n"
                    "echo 'Error: Failed to get stack traces' >&2; exit 1; fi\necho '    <module> (train.py:3)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert py_spy_dump(1, until="train.py:3") == (True, "<module> (train.py:3)")


def test_a_run_stopped_by_its_timeout_while_training_is_not_called_a_hang():
    """A slow machine (a cold start under load) can stop the right fix at the exercise's short --timeout:
    the checker then says to raise it, not that the run hangs."""
    from pathlib import Path

    from ddp_helpers.config import LaunchConfig
    from ddp_helpers.hang import HangReport, RankState
    from ddp_helpers.result import RankResult, RunResult

    busy = HangReport((RankState(0, "all_reduce", "#31", "[1, 4] float32", "world", "line 36"),
                       RankState(1, "not in a collective (running Python)", line="line 33")),
                      "rank 1 never called all_reduce #31, which rank 0 is waiting in (line 36): rank 1 is in your "
                      "code at line 33, in no collective.")
    run = RunResult(LaunchConfig(Path("/tmp/exercise.py"), 2, "gloo", 6.0, Path("/tmp/x")),
                    (RankResult(0, None, "", ""), RankResult(1, None, "", "")), 6.0, "gloo", ("cpu",) * 2, None,
                    True, hang=busy)
    text = str(check_hang_exercise(run))
    assert "did not finish within its --timeout of 6 s" in text and "raise --timeout" in text, text
    assert "the run hangs" not in text
