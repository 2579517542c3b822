"""Lesson 5's exercise (a training run that hangs at a step that looks random): the given script hangs
and the checker says where; the solution passes, and so does a fix through DDP; fixes that only hide the
hang, or change the training, do not, each with its first mistake named alone. Each rank's shard comes from
its secret, which only that rank's process is handed, so no rank can compute another's gradient."""


import pytest

from ddp_helpers.course.lessons.lesson5 import check_hang_exercise, exercise_reference, skipped_steps
from ddp_helpers.run_folder import RunFolder
from support import SOCKET_EXCHANGE, exercise_cells, failure_report, run_on_cpu

pytestmark = pytest.mark.usefixtures("warm_launches")  # the hanging runs are timed from a warm start
SKIP = "    if not keep.any():\n        continue  # nothing left to learn from on this rank\n"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, *_) = exercise_cells("05_when_things_go_wrong.ipynb")
    solution = solution.split("\n", 1)[1]  # the solution's cell, without its %%torchrun line
    assert SKIP in given
    return given, solution


def test_the_data_leaves_only_the_last_rank_an_empty_batch_at_a_step_drawn_for_each_run():
    # What makes the exercise hang at a step that looks random, every run at another step.
    import secrets

    for world in (2, 3):
        for _ in range(20):
            skipped = skipped_steps([secrets.randbits(62) for _ in range(world)])
            assert all(not steps for rank, steps in skipped.items() if rank < world - 1), skipped
            assert skipped[world - 1] and min(skipped[world - 1]) < 16, skipped


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


# The given script's end: the facts the checker reads.
RECORD_AND_END = """dist.barrier()
record("steps", done)
record("weights", [p.detach().cpu() for p in model.parameters()])
dist.destroy_process_group()
"""

# Every rank trains alone on its own shard, as if it were every rank's: no collective, other data.
EVERY_RANK_ALONE = """from ddp_helpers.course.lessons.lesson5 import my_shard
done = []
for step, (inputs, targets) in enumerate(my_shard()):
    keep = inputs.abs().max(dim=1).values < OUTLIER
    optimizer.zero_grad()
    if keep.any():
        torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep]).backward()
        optimizer.step()
    done.append(step)
""" + RECORD_AND_END

# Every rank trains on every rank's shard (SECRETS: every rank's secret, learned some other way than a collective),
# and all-reduces something for show (SHOWN).
EVERY_RANK_ON_EVERY_SHARD = """from ddp_helpers.course.lessons.lesson5 import shard
shards = [shard(secret, r == world_size - 1) for r, secret in enumerate(SECRETS)]
done = []
for step in range(STEPS):
    total = [torch.zeros_like(p) for p in model.parameters()]
    for inputs, targets in [next(each) for each in shards]:
        keep = inputs.abs().max(dim=1).values < OUTLIER
        if keep.any():
            loss = torch.nn.functional.mse_loss(model(inputs[keep]), targets[keep])
            total = [t + g for t, g in zip(total, torch.autograd.grad(loss, list(model.parameters())))]
    for p, t in zip(model.parameters(), total):
        p.grad = t / world_size
        dist.all_reduce(SHOWN)
    optimizer.step()
    done.append(step)
""" + RECORD_AND_END

EVERY_RANK_FROM_THE_STORE = """from ddp_helpers import rank_secret
store = dist.distributed_c10d._get_default_store()
store.set(f"secret{rank}", str(rank_secret()))
dist.barrier()
""" + EVERY_RANK_ON_EVERY_SHARD.replace("SECRETS", '[int(store.get(f"secret{r}")) for r in range(world_size)]').replace(
    "SHOWN", "p.grad.clone()")

# The fix through DDP: the zero gradient of an empty batch comes from a zero loss (DDP's all-reduce runs in C++).
THROUGH_DDP = """from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
done = []
for step in range(STEPS):
    inputs, targets = next(data)
    keep = inputs.abs().max(dim=1).values < OUTLIER
    inputs, targets, keep = inputs.to(device), targets.to(device), keep.to(device)
    optimizer.zero_grad()
    out = ddp(inputs)
    loss = torch.nn.functional.mse_loss(out[keep], targets[keep]) if keep.any() else out.sum() * 0
    loss.backward()
    optimizer.step()
    done.append(step)
""" + RECORD_AND_END


# The secrets passed over a raw socket, which the launcher does not watch; every rank computes every rank's gradient
# and all-reduces the average (its share of it) for show: the weights come out right.
EVERY_RANK_FROM_A_SOCKET = SOCKET_EXCHANGE + "from ddp_helpers import rank_secret\n" + EVERY_RANK_ON_EVERY_SHARD.replace(
    "SECRETS", "exchanged(rank_secret())").replace("SHOWN", "(p.grad / world_size).clone()")


def test_the_others_data_learned_over_a_raw_socket_is_judged_wrong_for_want_of_evidence(write_script, sources):
    """No list of cheats: the checker asks to see each rank's own gradient go into its all-reduces every step."""
    from support import free_port

    script = write_script("exercise", sources[0].split("done = []")[0] + EVERY_RANK_FROM_A_SOCKET)
    run = run_on_cpu(script, timeout_s=60, stream=False, extra_env={"SIDE_PORT": str(free_port())})
    report = check_hang_exercise(run)
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "no all-reduce the launcher saw carried rank" in str(report) and "own gradient" in str(report), str(report)
    assert "the weights are those of the intended training" in str(report), "the weights were right: only the road was"


def test_a_fix_through_ddp_passes(write_script, sources):
    run, report = judged(write_script, sources[0].split("done = []")[0] + THROUGH_DDP)
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"


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
        lambda s: s.split("done = []")[0] + "from ddp_helpers.course.lessons.lesson5 import exercise_reference\n"
                  "done = list(range(STEPS))\ndist.barrier()\nrecord('steps', done)\n"
                  "record('weights', exercise_reference(world_size))\ndist.destroy_process_group()\n",
        "the run did not finish"),
    "every rank trains alone": (lambda s: s.split("done = []")[0] + EVERY_RANK_ALONE, "too few all-reduces"),
    # All-reduces of zeros in the numbers a real training would make, and the weights of one rank's training.
    "all-reduces of zeros beside a rank's own training": (
        lambda s: s.split("done = []")[0] + EVERY_RANK_ALONE.replace(
            "    done.append(step)\n",
            "    for p in model.parameters():\n        dist.all_reduce(torch.zeros_like(p))\n    done.append(step)\n"),
        "the ranks' weights differ"),
    # Every rank's secret passed through the job's store, every shard's gradient computed on every rank, and
    # all-reduces for show.
    "every rank computes every gradient from secrets passed through the store": (
        lambda s: s.split("done = []")[0] + EVERY_RANK_FROM_THE_STORE, "key-value store call"),
    "no weights recorded": (lambda s: _solution().replace('record("weights", [p.detach().cpu() for p in model.parameters()])',
                                                          'record("weights", [])'),
                            "record('weights', ...) as given"),
}


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
    assert len(report.mistakes) == 1, f"one mistake, not its consequences: {report}"


def test_the_reference_depends_on_every_ranks_secret():
    import torch

    two, other = exercise_reference([1, 2]), exercise_reference([1, 3])
    assert not all(torch.equal(a, b) for a, b in zip(two, other)), "another rank's shard changes the training"
    assert all(torch.isfinite(p).all() for p in two)


def test_one_rank_is_not_enough(write_script, sources):
    # On one rank nothing can hang, and a skipped step costs nothing with plain SGD: no evidence of a fix.
    run = run_on_cpu(write_script("exercise", sources[1]), nproc=1, stream=False)
    report = check_hang_exercise(run)
    assert not report.passed and "run it on 2 ranks or more" in str(report), f"{report}\n{failure_report(run)}"


def test_py_spy_refused_by_ptrace_is_reported_not_raised(tmp_path, monkeypatch):
    # Ubuntu's default (Yama ptrace_scope 1): py-spy, not the ranks' ancestor, may not read them.
    from ddp_helpers.course.lessons.lesson5 import py_spy_dump

    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Operation not permitted (os error 1)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert py_spy_dump(1, until="never") == (False, "Error: Operation not permitted (os error 1)")


def test_a_py_spy_sample_that_fails_midway_is_taken_again(tmp_path, monkeypatch):
    # py-spy reads a live process: a sample can fail while the process changes its frames (seen in CI).
    from ddp_helpers.course.lessons.lesson5 import py_spy_dump

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

    from ddp_helpers.engines import LaunchConfig
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


def test_torchrun_shows_the_root_cause_traceback_only_with_record(tmp_path):
    """Deep dive 5b's check (section 2) that torchrun's summary holds the failing rank's traceback fails for the same script
    without `@record` (error_file: <N/A>); `torchrun_failures` reads which rank torchrun named, and when."""
    import nbformat

    from ddp_helpers.course.lessons.lesson5 import torchrun_failures
    from ddp_helpers.course.lessons.plain_torchrun import run_torchrun_command
    from support import course_notebook

    cells = nbformat.read(course_notebook("05b_debugging_on_a_cluster.ipynb"), as_version=4).cells
    source = next(c.source for c in cells if c.source.startswith("%%torchrun --name recorded")).split("\n", 1)[1]
    assert "@record" in source
    for decorated, script in ((True, source), (False, source.replace("@record", ""))):
        path = tmp_path / f"recorded_{decorated}.py"
        path.write_text(script)
        code, output = run_torchrun_command(["--standalone", "--nproc-per-node", "2", str(path)])
        named, times = torchrun_failures(output)
        root_cause = output[output.index("Root Cause"):]
        assert code != 0 and named in (0, 1) and set(times) == {0, 1}, output[-2000:]
        assert ("error_file: <N/A>" not in root_cause.split("=" * 20)[0]) == decorated, root_cause
