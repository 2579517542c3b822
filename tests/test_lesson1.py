"""Lesson 1's exercise: the checker names the deadlock of the script as given, passes the solution
shown (hidden) in the notebook, and refuses fixes that run but skip what the exercise is about: the
gradient never sent back, the activation never sent (each rank computing the whole model itself), the
wrong tensor sent, a stage handed the other's data (the inputs are rank 0's and the labels rank 1's, each
from that rank's secret). The scripts are taken from the notebook itself."""


import pytest

from ddp_helpers.course.lessons.lesson1 import (bubble_formula, check_pipeline_exercise, handoff_cost, idle_fractions,
                                          idle_with_handoffs, micro_batches_in_flight)
from support import exercise_cells, failure_report, run_on_cpu

NOTEBOOK = "01_data_vs_model_parallelism.ipynb"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, *_) = exercise_cells(NOTEBOOK, "%%torchrun -n 2 --name exercise")
    return given, solution.split("\n", 1)[1]


def test_the_given_pipeline_deadlocks_and_the_checker_says_where(write_script, sources, warm_launches):
    run = run_on_cpu(write_script("exercise", sources[0]), timeout_s=8, stream=False)
    report = check_pipeline_exercise(run)
    assert not report.passed
    text = str(report)
    assert "never finished: rank 0 in recv" in text and "rank 1 in recv" in text, text


def test_the_solution_passes(write_script, sources):
    run = run_on_cpu(write_script("exercise", sources[1]), stream=False)
    assert run.ok, failure_report(run)
    report = check_pipeline_exercise(run)
    assert report.passed, str(report)


def test_a_non_blocking_fix_passes_too(write_script, sources):
    # irecv posted before the send: as right as reordering (the launcher sees an irecv without its values).
    # And stage 1 taking its gradient with torch.autograd.grad instead of .grad: as right.
    nonblocking = sources[0].replace(
        "    dist.recv(grad, src=1)                    # the gradient of the activation, from stage 1\n"
        "    dist.send(activation.detach(), dst=1)     # the activation, to stage 1\n",
        "    pending = dist.irecv(grad, src=1)\n"
        "    dist.send(activation.detach(), dst=1)\n"
        "    pending.wait()\n").replace(
        "    loss.backward()\n    dist.send(activation.grad, dst=0)\n",
        "    activation_grad, *parameter_grads = torch.autograd.grad(loss, [activation, *stage.parameters()])\n"
        "    for p, g in zip(stage.parameters(), parameter_grads):\n        p.grad = g\n"
        "    dist.send(activation_grad, dst=0)\n")
    assert nonblocking.count("autograd.grad") == 1 and "irecv" in nonblocking
    run = run_on_cpu(write_script("exercise", nonblocking), stream=False)
    assert run.ok, failure_report(run)
    report = check_pipeline_exercise(run)
    assert report.passed, str(report)


def test_a_fix_that_runs_but_never_sends_the_gradient_back_fails(write_script, sources):
    wrong = sources[1].replace("    grad = torch.empty_like(activation)\n", "").replace(
        "    dist.recv(grad, src=1)                    # the gradient of the activation, from stage 1\n", "").replace(
        "    activation.backward(grad)\n", "").replace("    dist.send(activation.grad, dst=0)\n", "")
    assert wrong != sources[1]
    run = run_on_cpu(write_script("exercise", wrong), stream=False)
    assert run.ok, failure_report(run)
    text = str(check_pipeline_exercise(run))
    assert "no gradient reached stage0" in text, text


SHORTCUTS = {
    # Both ranks run the whole model on their own, no communication at all: the numbers are right.
    "no communication, every rank computes the whole model": (
        lambda solution: solution.replace(
            solution[solution.index("if rank == 0:\n    inputs"):solution.index('record("grads"')],
            "inputs, targets = my_inputs(), my_targets()\n"
            "activation = full[:4](inputs.to(device))\n"
            "loss = torch.nn.functional.cross_entropy(full[4:](activation), targets.to(device))\n"
            "loss.backward()\n"
            "if rank == 1:\n    record(\"loss\", loss.item())\n"),
        "the activation never crossed from rank 0 to rank 1"),
    # Real messages with the right values, for show: every rank computes the whole model itself, rank 1 sends
    # back the gradient of its own activation, and what each rank received is thrown away.
    "messages sent for show, every rank computes the whole model": (
        lambda solution: solution.replace(
            solution[solution.index("if rank == 0:\n    inputs"):solution.index('record("grads"')],
            "inputs, targets = my_inputs(), my_targets()\n"
            "activation = full[:4](inputs.to(device))\n"
            "activation.retain_grad()\n"
            "loss = torch.nn.functional.cross_entropy(full[4:](activation), targets.to(device))\n"
            "loss.backward()\n"
            "if rank == 0:\n"
            "    dist.send(activation.detach(), dst=1)\n"
            "    dist.recv(torch.empty_like(activation), src=1)\n"
            "else:\n"
            "    dist.recv(torch.empty(8, 32, device=device), src=0)\n"
            "    dist.send(activation.grad, dst=0)\n"
            "    record(\"loss\", loss.item())\n"),
        "what came back from rank 1 to rank 0 is not the gradient"),
    # Stage 1 hands its labels to stage 0, which computes both stages itself and ignores the gradient it gets.
    "the labels sent to stage 0, which computes both stages": (
        lambda solution: solution.replace(
            "    activation.backward(grad)\n",
            "    labels = torch.empty(8, dtype=torch.int64)\n"
            "    dist.recv(labels, src=1)\n"
            "    torch.nn.functional.cross_entropy(full[4:](activation), labels).backward()\n").replace(
            "    dist.send(activation.grad, dst=0)\n", "    dist.send(activation.grad, dst=0)\n    dist.send(targets, dst=0)\n"),
        "rank 1 sent 1,088 bytes point to point, more than the 1,024"),
    "the labels gathered by every rank": (
        lambda solution: solution.replace(
            "if rank == 0:\n    inputs", "labels = [None, None]\ndist.all_gather_object(labels, my_targets())\n"
                                        "if rank == 0:\n    inputs"),
        "the ranks also ran all_gather"),
    # The activation goes over, but rank 1 works on its own copy, computed from the inputs.
    "the input sent instead of the activation": (
        lambda solution: solution.replace("dist.send(activation.detach(), dst=1)",
                                          "dist.send(torch.zeros(8, 32, device=device), dst=1)"),
        "what rank 0 sent to rank 1 is not stage 0's output"),
}


@pytest.mark.parametrize("shortcut", list(SHORTCUTS))
def test_a_shortcut_that_skips_the_pipeline_fails(write_script, sources, shortcut):
    make, named = SHORTCUTS[shortcut]
    wrong = make(sources[1])
    assert wrong != sources[1]
    run = run_on_cpu(write_script("exercise", wrong), stream=False)
    assert run.ok, failure_report(run)
    report = check_pipeline_exercise(run)
    assert not report.passed and named in str(report), str(report)


def test_idle_fraction_and_formula():
    timeline = [{"pieces": [{"start": 0.0, "end": 1.0}], "total": 2.0},
                {"pieces": [{"start": 1.0, "end": 2.0}], "total": 2.0}]
    assert idle_fractions(timeline) == [0.5, 0.5]
    assert bubble_formula(2, 1) == 0.5 and bubble_formula(2, 4) == 0.2 and bubble_formula(4, 1) == 0.75


def test_hand_offs_are_the_gaps_on_the_pacing_stage_and_add_to_the_formula():
    # Two micro-batches, f = b = 1: rank 0's forwards 0.5 apart, rank 1's backwards 0.3 apart.
    piece = lambda kind, start: {"kind": kind, "start": start, "end": start + 1.0}  # noqa: E731
    timeline = [{"pieces": [piece("forward", 0.0), piece("forward", 1.5), piece("backward", 9.0)], "total": 10.0},
                {"pieces": [piece("forward", 2.0), piece("backward", 4.0), piece("backward", 5.3)], "total": 10.0}]
    assert handoff_cost(timeline) == pytest.approx(0.4)
    assert handoff_cost([{"pieces": [piece("forward", 0.0)]}, {"pieces": [piece("backward", 1.0)]}]) == 0.0
    assert idle_with_handoffs(4, 1.0, 0.0) == pytest.approx(bubble_formula(2, 4))
    # m = 8, f + b = 1, o = 0.25: the run lasts 9 + 4 = 13, each stage computes 8 of it.
    assert idle_with_handoffs(8, 1.0, 0.25) == pytest.approx(5 / 13)


def test_micro_batches_in_flight_counts_forwards_whose_backward_has_not_run():
    piece = lambda kind, start: {"kind": kind, "start": start, "end": start + 0.5}  # noqa: E731
    gpipe = [piece("forward", t) for t in range(4)] + [piece("backward", 4 + t) for t in range(4)]
    one_f_one_b = [piece("forward", 0), piece("forward", 1), piece("backward", 2), piece("forward", 3),
                   piece("backward", 4), piece("forward", 5), piece("backward", 6), piece("backward", 7)]
    assert micro_batches_in_flight(gpipe) == 4
    assert micro_batches_in_flight(list(reversed(one_f_one_b))) == 2  # by start time, not by list order


def test_stage_zero_computing_the_loss_with_labels_from_a_raw_socket_fails(write_script, sources):
    """Rank 1 sends its labels to rank 0 over a raw socket, which the launcher does not watch; rank 0 runs the whole
    model and the loss itself, while the activation and its gradient still cross for show. The gradients are right:
    only the missing evidence (no backward on rank 0 from the gradient that came back) shows it."""
    from support import SOCKET_EXCHANGE, free_port

    cheat = SOCKET_EXCHANGE + sources[1].replace(
        "    dist.send(activation.detach(), dst=1)     # the activation, to stage 1\n",
        "    dist.send(activation.detach(), dst=1)     # the activation, to stage 1\n"
        "    labels = torch.tensor(exchanged(None)[1])\n").replace(
        "    activation.backward(grad)\n",
        "    torch.nn.functional.cross_entropy(full[4:](activation), labels.to(device)).backward()\n").replace(
        "    targets = my_targets()\n", "    targets = my_targets()\n    exchanged(targets.tolist())\n")
    assert cheat.count("exchanged(") == 3, cheat
    run = run_on_cpu(write_script("exercise", cheat), stream=False, extra_env={"SIDE_PORT": str(free_port())})
    assert run.ok, failure_report(run)
    report = check_pipeline_exercise(run)
    assert not report.passed and "no backward on rank 0 used it" in str(report), str(report)


def test_stage_zero_may_start_its_backward_from_the_gradient_in_any_form(write_script, sources):
    """activation.backward(grad), torch.autograd.backward, or the gradient as a weight in a sum: all right."""
    for backward in ("    torch.autograd.backward([activation], [grad])\n",
                     "    (activation * grad.clone()).sum().backward()\n"):
        script = sources[1].replace("    activation.backward(grad)\n", backward)
        run = run_on_cpu(write_script("exercise", script), stream=False)
        report = check_pipeline_exercise(run)
        assert run.ok and report.passed, f"{backward}: {report}\n{failure_report(run)}"
