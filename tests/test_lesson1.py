"""Lesson 1's exercise, 1F1B by hand: the checker names what the script as given does (stage 0 holds all four
micro-batches), passes the solution shown (hidden) in the notebook and the other right route (the send and the
receive posted together, as torch's Schedule1F1B does), and refuses what runs but is not 1F1B: both stages sending
first (a hang), an isend before the recv (finishes on gloo, can hang on nccl), the next activation sent only after
the backward (stage 1 starved), forwards hidden from what the rank measures (activation checkpointing), the last stage
left as GPipe, and the shortcuts that skip the pipeline: the gradient never sent back, the activations never sent
(each rank computing the whole model itself), the wrong tensor sent, a stage handed the other's data (the inputs
are rank 0's and the labels rank 1's, each from that rank's secret). The scripts are taken from the notebook."""


import pytest

from ddp_helpers.course.lessons.lesson1 import (bubble_formula, check_pipeline_exercise, handoff_cost, idle_fractions,
                                          idle_with_handoffs, micro_batches_in_flight)
from ddp_helpers.course.nccl_order import stuck_on_nccl
from support import exercise_cells, failure_report, run_on_cpu

NOTEBOOK = "01_data_vs_model_parallelism.ipynb"
# Stage 0's loop in the solution, which the right and wrong routes below replace.
LOOP_START, LOOP_END = "    for k in range(m):                                  # 1F1B", "else:\n    micro_targets"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, batched_loop, *_) = exercise_cells(NOTEBOOK, "%%torchrun -n 2 --name exercise")
    return given, solution.split("\n", 1)[1], batched_loop


def stage_zero_loop(solution: str, loop: str) -> str:
    """The solution with stage 0's loop replaced by `loop`."""
    old = solution[solution.index(LOOP_START):solution.index(LOOP_END)]
    return solution.replace(old, loop)


def judged(write_script, script: str, **options):
    run = run_on_cpu(write_script("exercise", script), stream=False, **options)
    return run, check_pipeline_exercise(run)


def test_the_given_gpipe_holds_four_micro_batches_and_the_checker_says_so(write_script, sources):
    run, report = judged(write_script, sources[0])
    assert run.ok, failure_report(run)
    text = str(report)
    assert not report.passed and "stage 0 held the activations of 4 micro-batches at once" in text, text
    assert "both stages' gradients equal the unsplit model's" in text, text  # GPipe is right, only not 1F1B


def test_the_solution_passes(write_script, sources):
    run, report = judged(write_script, sources[1])
    assert run.ok, failure_report(run)
    assert report.passed, str(report)
    assert "stage 0 held at most 2 micro-batches' activations" in str(report), str(report)


def test_the_send_and_receive_posted_together_pass_too(write_script, sources):
    # torch's way (batch_isend_irecv), with stage 1 taking its gradient with torch.autograd.grad: as right.
    script = stage_zero_loop(sources[1], sources[2]).replace(
        "        loss.backward()\n        dist.send(activation.grad, dst=0)\n",
        "        activation_grad, *parameter_grads = torch.autograd.grad(loss, [activation, *stage.parameters()])\n"
        "        for p, g in zip(stage.parameters(), parameter_grads):\n"
        "            p.grad = g if p.grad is None else p.grad + g\n"
        "        dist.send(activation_grad, dst=0)\n")
    assert "batch_isend_irecv" in script and script.count("autograd.grad") == 1
    run, report = judged(write_script, script)
    assert run.ok, failure_report(run)
    assert report.passed, str(report)


def test_both_stages_sending_first_hang_and_the_checker_says_where(write_script, sources, warm_launches):
    crossed = stage_zero_loop(sources[1], """\
    for k in range(m):
        if k + 1 < m:
            activations[k + 1] = stage(micro_inputs[k + 1])
            dist.send(activations[k + 1].detach(), dst=1)
        grad = torch.empty_like(activations[k])
        dist.recv(grad, src=1)
        activations.pop(k).backward(grad)
""")
    run, report = judged(write_script, crossed, timeout_s=8)
    text = str(report)
    assert run.timed_out and not report.passed, failure_report(run)
    assert "never finished: rank 0 in send" in text and "rank 1 in send" in text, text
    assert "two ranks that both send first wait for each other" in text, text


def test_an_isend_before_the_recv_finishes_here_but_would_hang_on_nccl(write_script, sources):
    isend = stage_zero_loop(sources[1], """\
    for k in range(m):
        if k + 1 < m:
            activations[k + 1] = stage(micro_inputs[k + 1])
            pending = dist.isend(activations[k + 1].detach(), dst=1)
        grad = torch.empty_like(activations[k])
        dist.recv(grad, src=1)
        if k + 1 < m:
            pending.wait()
        activations.pop(k).backward(grad)
""")
    run, report = judged(write_script, isend)
    assert run.ok, failure_report(run)
    text = str(report)
    assert not report.passed and "on GPUs it can hang, rank 0 in its isend to rank 1" in text, text
    assert "both stages' gradients equal the unsplit model's" in text, text


def test_the_activation_sent_after_the_backward_starves_stage_one(write_script, sources):
    # The next forward runs before the gradient comes back, but its activation leaves only after the backward.
    late = stage_zero_loop(sources[1], """\
    for k in range(m):
        if k + 1 < m:
            activations[k + 1] = stage(micro_inputs[k + 1])
        grad = torch.empty_like(activations[k])
        dist.recv(grad, src=1)
        activations.pop(k).backward(grad)
        if k + 1 < m:
            dist.send(activations[k + 1].detach(), dst=1)
""")
    run, report = judged(write_script, late)
    assert run.ok, failure_report(run)
    text = str(report)
    assert not report.passed and "ran micro-batch 0's backward before it sent micro-batch 1's activation" in text, text


def test_forwards_hidden_from_autograds_count_are_named(write_script, sources):
    # GPipe with two forwards under activation checkpointing: autograd saves (and the rank sees) only two of four.
    hidden = sources[0].replace(
        "        activations.append(stage(micro_inputs[k]))\n",
        "        if k < 2:\n"
        "            import torch.utils.checkpoint\n"
        "            activations.append(torch.utils.checkpoint.checkpoint(stage, micro_inputs[k], use_reentrant=False))\n"
        "        else:\n"
        "            activations.append(stage(micro_inputs[k]))\n")
    assert hidden != sources[0]
    run, report = judged(write_script, hidden)
    assert run.ok, failure_report(run)
    text = str(report)
    assert not report.passed and "seen saving the activations of only 2 of stage 0's 4 forwards" in text, text


def test_the_last_stage_holding_every_micro_batch_fails(write_script, sources):
    # Stage 0 sends every activation first, computed without autograd, then recomputes one ahead: stage 0 holds
    # little, but stage 1 is the given GPipe, holding all four.
    given_stage_one = sources[0][sources[0].index("else:\n    micro_targets"):sources[0].index('record("grads"')]
    recompute = stage_zero_loop(sources[1], """\
    for k in range(m):
        if k + 1 < m:
            activations[k + 1] = stage(micro_inputs[k + 1])
        grad = torch.empty_like(activations[k])
        dist.recv(grad, src=1)
        activations.pop(k).backward(grad)
""").replace("    dist.send(activations[0].detach(), dst=1)\n",
             "    with torch.no_grad():\n"
             "        for k in range(m):\n"
             "            dist.send(stage(micro_inputs[k]), dst=1)\n")
    solution_stage_one = recompute[recompute.index("else:\n    micro_targets"):recompute.index('record("grads"')]
    recompute = recompute.replace(solution_stage_one, given_stage_one)
    run, report = judged(write_script, recompute)
    assert run.ok, failure_report(run)
    text = str(report)
    assert not report.passed and "stage 1, the last stage, held the activations of 4 micro-batches" in text, text


def test_a_receive_posted_early_and_gradients_averaged_at_the_end_pass(write_script, sources):
    # Two more right routes: stage 0 posts each gradient's irecv before the next forward (waited on after it), and
    # both stages average at the end instead of dividing each micro-batch's loss (so m times the gradients cross).
    early = stage_zero_loop(sources[1], """\
    for k in range(m):
        grad = torch.empty_like(activations[k])
        pending = dist.irecv(grad, src=1)
        if k + 1 < m:
            activations[k + 1] = stage(micro_inputs[k + 1])
        pending.wait()
        if k + 1 < m:
            dist.send(activations[k + 1].detach(), dst=1)
        activations.pop(k).backward(grad)
    for p in stage.parameters():
        p.grad /= m
""").replace("micro_targets[k]) / m\n", "micro_targets[k])\n").replace(
        '    record("loss", sum(losses))\n',
        '    for p in stage.parameters():\n        p.grad /= m\n    record("loss", sum(losses) / m)\n')
    assert early.count("p.grad /= m") == 2
    run, report = judged(write_script, early)
    assert run.ok, failure_report(run)
    assert report.passed, str(report)


def test_a_fix_that_runs_but_never_sends_the_gradient_back_fails(write_script, sources):
    wrong = sources[1].replace(
        "        dist.recv(grad, src=1)                          # the gradient of micro-batch k's activation\n", "").replace(
        "        activations.pop(k).backward(grad)               # frees micro-batch k's activations\n",
        "        activations.pop(k)\n").replace("        dist.send(activation.grad, dst=0)\n", "")
    assert wrong.count("dist.send") == 2 and "dist.recv(grad" not in wrong
    run, report = judged(write_script, wrong)
    assert run.ok, failure_report(run)
    assert "no gradient reached stage 0" in str(report), str(report)


WHOLE_MODEL = (  # every rank computes the whole model on the whole batch itself
    "inputs, targets = my_inputs().to(device), my_targets().to(device)\n"
    "activation = full[:4](inputs)\n"
    "activation.retain_grad()\n"
    "loss = torch.nn.functional.cross_entropy(full[4:](activation), targets)\n"
    "loss.backward()\n")


def both_stages(solution: str, replacement: str) -> str:
    return solution.replace(solution[solution.index("if rank == 0:\n    micro_inputs"):solution.index('record("grads"')],
                            replacement)


SHORTCUTS = {
    # Both ranks run the whole model on their own, no communication at all: the numbers are right.
    "no communication, every rank computes the whole model": (
        lambda solution: both_stages(solution, WHOLE_MODEL + "if rank == 1:\n    record(\"loss\", loss.item())\n"),
        "the activations never crossed from rank 0 to rank 1"),
    # Real messages, for show: every rank computes the whole model itself (rank 1 on inputs its own secret draws:
    # it cannot know rank 0's), rank 1 sends back the gradient of its own activation, and what each rank received
    # is thrown away.
    "messages sent for show, every rank computes the whole model": (
        lambda solution: both_stages(solution, WHOLE_MODEL +
            "for k in range(m):\n"
            "    if rank == 0:\n"
            "        dist.send(activation[8 * k:8 * k + 8].detach().contiguous(), dst=1)\n"
            "        dist.recv(torch.empty(8, 32, device=device), src=1)\n"
            "    else:\n"
            "        dist.recv(torch.empty(8, 32, device=device), src=0)\n"
            "        dist.send(activation.grad[8 * k:8 * k + 8].contiguous(), dst=0)\n"
            "if rank == 1:\n    record(\"loss\", loss.item())\n"),
        "what came back from rank 1 to rank 0 does not include the gradient"),
    # Stage 1 hands its labels to stage 0 as well.
    "the labels sent to stage 0": (
        lambda solution: solution.replace(
            "else:\n    micro_targets", "    labels = torch.empty(32, dtype=torch.int64)\n    dist.recv(labels, src=1)\n"
                                       "else:\n    micro_targets").replace(
            '    record("loss", sum(losses))\n', '    dist.send(my_targets(), dst=0)\n    record("loss", sum(losses))\n'),
        "rank 1 sent 4,352 bytes point to point, more than the 4,096"),
    "the labels gathered by every rank": (
        lambda solution: solution.replace(
            "if rank == 0:\n    micro_inputs", "labels = [None, None]\ndist.all_gather_object(labels, my_targets())\n"
                                             "if rank == 0:\n    micro_inputs"),
        "the ranks also ran all_gather"),
    # The activations go over, but some are zeros: stage 1 works on something else.
    "zeros sent instead of an activation": (
        lambda solution: solution.replace("            dist.send(activations[k + 1].detach(), dst=1)",
                                          "            dist.send(torch.zeros(8, 32, device=device), dst=1)"),
        "stage 0's output on micro-batch 1 (rows 8 to 15 of the batch) never went from rank 0 to rank 1"),
}


@pytest.mark.parametrize("shortcut", list(SHORTCUTS))
def test_a_shortcut_that_skips_the_pipeline_fails(write_script, sources, shortcut):
    make, named = SHORTCUTS[shortcut]
    wrong = make(sources[1])
    assert wrong != sources[1]
    run, report = judged(write_script, wrong)
    assert run.ok, failure_report(run)
    assert not report.passed and named in str(report), str(report)


def test_the_nccl_replay_pairs_calls_in_order_and_runs_a_batch_together():
    call = lambda op, peer, number, batch=None: {"op": op, "peer": peer, "number": number,  # noqa: E731
                                                 **({} if batch is None else {"batch": batch})}
    # Stage 0 receives before it sends the next activation; stage 1 receives, then sends: every call pairs up.
    matched = [[call("send", 1, 1), call("recv", 1, 2), call("send", 1, 3), call("recv", 1, 4)],
               [call("recv", 0, 1), call("send", 0, 2), call("recv", 0, 3), call("send", 0, 4)]]
    assert stuck_on_nccl(matched) is None
    # Both send first: on the GPU each waits for a receive queued behind the other's send.
    crossed = [[call("isend", 1, 1), call("recv", 1, 2)], [call("send", 0, 1), call("irecv", 0, 2)]]
    stuck = stuck_on_nccl(crossed)
    assert stuck is not None and stuck[0]["op"] == "isend" and stuck[1]["op"] == "send"
    # The same two calls as one batch on rank 0 progress together: done.
    batched = [[call("isend", 1, 1, batch=0), call("irecv", 1, 2, batch=0)], [call("send", 0, 1), call("recv", 0, 2)]]
    assert stuck_on_nccl(batched) is None
    # A receive nobody sends to is stuck on its own; backwards in the log are not point-to-point calls.
    assert stuck_on_nccl([[{"op": "backward"}, call("recv", 1, 1)], []]) == {0: call("recv", 1, 1)}


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
    model and the loss itself, while the activations and their gradients still cross for show. The gradients are
    right: only the missing evidence (no backward on rank 0 from the gradients that came back) shows it."""
    from support import SOCKET_EXCHANGE, free_port

    cheat = SOCKET_EXCHANGE + sources[1].replace(
        "    micro_inputs = my_inputs().to(device).chunk(m)",
        "    labels = torch.tensor(exchanged(None)[1]).to(device).chunk(m)\n"
        "    micro_inputs = my_inputs().to(device).chunk(m)").replace(
        "        activations.pop(k).backward(grad)               # frees micro-batch k's activations\n",
        "        (torch.nn.functional.cross_entropy(full[4:](activations.pop(k)), labels[k]) / m).backward()\n").replace(
        "    micro_targets = my_targets().to(device).chunk(m)\n",
        "    micro_targets = my_targets().to(device).chunk(m)\n    exchanged(torch.cat(micro_targets).tolist())\n")
    assert cheat.count("exchanged(") == 3, cheat
    run, report = judged(write_script, cheat, extra_env={"SIDE_PORT": str(free_port())})
    assert run.ok, failure_report(run)
    assert not report.passed and "no backward on rank 0 used one of them" in str(report), str(report)


def test_stage_zero_may_start_its_backward_from_the_gradient_in_any_form(write_script, sources):
    """activation.backward(grad), torch.autograd.backward, or the gradient as a weight in a sum: all right."""
    for backward in ("        torch.autograd.backward([activations.pop(k)], [grad])\n",
                     "        (activations.pop(k) * grad.clone()).sum().backward()\n"):
        script = sources[1].replace(
            "        activations.pop(k).backward(grad)               # frees micro-batch k's activations\n", backward)
        assert script != sources[1]
        run, report = judged(write_script, script)
        assert run.ok and report.passed, f"{backward}: {report}\n{failure_report(run)}"
