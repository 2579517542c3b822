"""Lesson 6's arithmetic (bus bandwidth as nccl-tests define it, the alpha-beta fit) and the all-reduce
benchmark run for real on CPU ranks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_helpers.course.lessons.lesson6 import AlphaBeta, bandwidths, fit_alpha_beta, ring_factor

ROOT = Path(__file__).resolve().parent.parent


def test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor():
    assert ring_factor(2) == 1.0 and ring_factor(4) == 1.5 and ring_factor(8) == 1.75
    [point] = bandwidths([{"bytes": 1 << 20, "seconds": 0.001}], world_size=4)
    assert point["algbw"] == pytest.approx((1 << 20) / 0.001) and point["busbw"] == pytest.approx(point["algbw"] * 1.5)


def test_the_fit_recovers_latency_and_bandwidth_from_points_that_follow_the_model():
    truth = AlphaBeta(alpha_s=50e-6, beta_bytes_per_s=2e9)
    points = [{"bytes": size, "seconds": truth.predict(size) * noise}
              for size, noise in zip([1 << k for k in range(10, 27, 2)], [1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0, 1.01])]
    fit = fit_alpha_beta(points)
    assert fit.alpha_s == pytest.approx(50e-6, rel=0.1) and fit.beta_bytes_per_s == pytest.approx(2e9, rel=0.1)


def test_points_that_do_not_follow_the_model_are_refused():
    shrinking = [{"bytes": 1 << 10, "seconds": 1.0}, {"bytes": 1 << 20, "seconds": 0.001}]  # more bytes, less time
    with pytest.raises(ValueError, match="do not follow"):
        fit_alpha_beta(shrinking)


def test_the_benchmark_measures_all_reduce_on_this_machine(tmp_path):
    done = subprocess.run(
        # Up to 16 MiB: below about 1 MiB the times are all latency, and on a busy machine their noise alone can
        # give the fit a negative slope.
        [sys.executable, str(ROOT / "benchmarks" / "allreduce.py"), "--max-mib", "16", "--repeats", "3",
         "--json", str(tmp_path / "points.json"), "--plot", str(tmp_path / "plot.png")],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads((tmp_path / "points.json").read_text())
    assert [p["bytes"] for p in saved["points"]] == [1 << k for k in range(10, 25, 2)]
    assert all(p["seconds"] > 0 for p in saved["points"]) and saved["beta_bytes_per_s"] > 0
    assert "alpha-beta fit: latency alpha =" in done.stdout and "busbw (GB/s)" in done.stdout
    assert (tmp_path / "plot.png").stat().st_size > 10_000


# ---- the exercise: a quarter of the bytes, the same training -------------------------------------------

from ddp_helpers.course.lessons.lesson6.exercise import all_reduce_bytes, check_compression_exercise, exercise_reference, parameter_bytes  # noqa: E402
from support import exercise_cells, failure_report, run_on_cpu  # noqa: E402
from ddp_helpers.course.records import records

WRAP = "ddp = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)\n"


@pytest.fixture(scope="module")
def given():
    """(the script as given, made to all-reduce once a step with the solution's loop; the solution's hook lines).
    Every hook below is tried on the once-a-step script: its bytes and weights are then the hook's doing."""
    _, script, (hook, loop, *_) = exercise_cells("06_is_it_fast.ipynb")
    assert WRAP in script and "fp16_compress_hook" in hook and "no_sync" in loop
    return script, with_loop(script, "import contextlib\n" + loop), hook


GIVEN_LOOP = re.compile(r"^for step in range\(STEPS\):\n(?:    .*\n)+", re.M)


def with_loop(script: str, loop: str) -> str:
    """The script with its training loop replaced by `loop` (which may start with imports)."""
    assert GIVEN_LOOP.search(script), "the exercise's loop changed"
    return GIVEN_LOOP.sub(lambda _: loop.rstrip("\n") + "\n", script, count=1)


def with_hook(script: str, lines: str) -> str:
    """The script with `lines` right after the DDP wrap."""
    return script.replace(WRAP, WRAP + lines)


def judged(write_script, source: str):
    run = run_on_cpu(write_script("exercise", source), stream=False, timeout_s=120)
    return run, check_compression_exercise(run)


def test_the_given_script_trains_but_sends_every_byte(write_script, given):
    run, report = judged(write_script, given[0])
    assert run.ok and not report.passed, failure_report(run)
    assert "100% of the" in str(report) and "over a quarter" in str(report), str(report)
    assert "weights are the uncompressed training's" in str(report), str(report)
    assert len(report.mistakes) == 1, f"an honest script's only mistake is its bytes:\n{report}"


def test_the_solution_passes_with_one_float16_all_reduce_a_step(write_script, given):
    run, report = judged(write_script, with_hook(given[1], given[2]))
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"
    sent = [size for size in all_reduce_bytes(records(run)[0].collectives) if size > 64]
    assert sent and set(sent) == {parameter_bytes() // 2} and len(sent) == 30, sent


# Another right route: no micro-batches at all, the whole share in one forward and backward (where memory allows).
WHOLE_SHARE = """for step in range(STEPS):
    inputs, targets = my_batch(step)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(inputs.to(device)), targets.to(device)) / 2  # printed as 2 * loss
    (2 * loss).backward()
    optimizer.step()
"""
# Wrong: no_sync around the last micro-batch instead of the first: the first is averaged, the last stays each
# rank's own, and the ranks step on different gradients.
NO_SYNC_ON_THE_LAST = """import contextlib
for step in range(STEPS):
    inputs, targets = my_batch(step)
    optimizer.zero_grad()
    for index, (micro_inputs, micro_targets) in enumerate(zip(inputs.chunk(2), targets.chunk(2))):
        with ddp.no_sync() if index == 1 else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(ddp(micro_inputs.to(device)), micro_targets.to(device)) / 2
            loss.backward()
    optimizer.step()
"""


# Another right route: the first micro-batch through the wrapped module itself, which DDP's forward never sees, so
# its backward only accumulates (what no_sync does, by another road).
FIRST_THROUGH_THE_MODULE = """for step in range(STEPS):
    inputs, targets = my_batch(step)
    optimizer.zero_grad()
    for index, (micro_inputs, micro_targets) in enumerate(zip(inputs.chunk(2), targets.chunk(2))):
        forward = ddp if index == 1 else ddp.module
        loss = torch.nn.functional.mse_loss(forward(micro_inputs.to(device)), micro_targets.to(device)) / 2
        loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("loop", [WHOLE_SHARE, FIRST_THROUGH_THE_MODULE], ids=["whole-share", "first-through-the-module"])
def test_other_right_routes_pass(write_script, given, loop):
    run, report = judged(write_script, with_hook(with_loop(given[0], loop), given[2]))
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"


# Wrong: the forward outside no_sync, only the backward inside it: DDP decided in the forward to all-reduce.
NO_SYNC_AROUND_THE_BACKWARD_ONLY = """import contextlib
for step in range(STEPS):
    inputs, targets = my_batch(step)
    optimizer.zero_grad()
    for index, (micro_inputs, micro_targets) in enumerate(zip(inputs.chunk(2), targets.chunk(2))):
        loss = torch.nn.functional.mse_loss(ddp(micro_inputs.to(device)), micro_targets.to(device)) / 2
        with ddp.no_sync() if index == 0 else contextlib.nullcontext():
            loss.backward()
    optimizer.step()
"""


# `no_sync` alone (one float32 all-reduce a step) is judged as PowerSGD with its defaults is, below: the same bytes.
@pytest.mark.parametrize("lever, said", [
    ("compression only", "60 gradient all-reduces in 30 steps, 2 a step, each carrying 50%"),
    ("no_sync around the backward only, and compression", "60 gradient all-reduces in 30 steps, 2 a step, each carrying 50%"),
])
def test_one_lever_alone_sends_half_of_the_given_bytes_and_is_told_which(write_script, given, lever, said):
    script = {"compression only": with_hook(given[0], given[2]),
              "no_sync around the backward only, and compression": with_hook(
                  with_loop(given[0], NO_SYNC_AROUND_THE_BACKWARD_ONLY), given[2])}[lever]
    run, report = judged(write_script, script)
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "50% of the" in str(report) and "over a quarter" in str(report) and said in str(report), str(report)


def test_no_sync_on_the_wrong_micro_batch_leaves_the_ranks_apart(write_script, given):
    run, report = judged(write_script, with_hook(with_loop(given[0], NO_SYNC_ON_THE_LAST), given[2]))
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "the ranks ended with different weights: they stepped on different gradients" in str(report), str(report)


POWERSGD = ("from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook\n"
            "ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None{options}), powerSGD_hook.powerSGD_hook)\n")
# A hook that sends half of each bucket and drops the rest: half the bytes, the ranks equal, half the gradient lost.
DROP_HALF = """def drop_half(state, bucket):
    buffer = bucket.buffer()
    half = buffer[: buffer.numel() // 2].div_(world_size)
    def done(future):
        buffer[: half.numel()] = future.value()[0]
        buffer[half.numel():] = 0
        return buffer
    return dist.all_reduce(half, async_op=True).get_future().then(done)
ddp.register_comm_hook(None, drop_half)
"""
# Half the bytes all-reduced for show, the float32 gradients all-gathered: the same training, 1.5 times the bytes.
FAKE_FP16 = """def fake_fp16(state, bucket):
    buffer = bucket.buffer()
    dist.all_reduce(buffer.to(torch.float16))
    shares = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(shares, buffer)
    future = torch.futures.Future()
    future.set_result(sum(shares) / world_size)
    return future
ddp.register_comm_hook(None, fake_fp16)
"""
# The float32 gradients through the default store, and float16 zeros all-reduced for the byte count.
THROUGH_THE_STORE = """store = dist.distributed_c10d._get_default_store()
calls = [0]
def through_the_store(state, bucket):
    buffer = bucket.buffer()
    key = f"grad-{calls[0]}-{bucket.index()}"
    calls[0] += 1
    store.set(f"{key}-{rank}", buffer.cpu().numpy().tobytes())
    dist.all_reduce(torch.zeros(buffer.numel(), dtype=torch.float16))
    shares = [torch.frombuffer(bytearray(store.get(f"{key}-{r}")), dtype=torch.float32) for r in range(world_size)]
    future = torch.futures.Future()
    future.set_result(sum(shares) / world_size)
    return future
ddp.register_comm_hook(None, through_the_store)
"""


# The float32 gradients through files (a channel nothing counts), and float16 zeros all-reduced for the count.
THROUGH_FILES = """import os
folder = f"grads-{os.environ['TORCHELASTIC_RUN_ID']}"  # beside the script, in the test's folder
os.makedirs(folder, exist_ok=True)
calls = [0]
def through_files(state, bucket):
    buffer = bucket.buffer()
    key = f"grad-{calls[0]}-{bucket.index()}"
    calls[0] += 1
    torch.save(buffer.clone(), os.path.join(folder, f"{key}-{rank}"))
    dist.all_reduce(torch.zeros(buffer.numel(), dtype=torch.float16))  # also a barrier: every file is written
    shares = [torch.load(os.path.join(folder, f"{key}-{r}")) for r in range(world_size)]
    future = torch.futures.Future()
    future.set_result(sum(shares) / world_size)
    return future
ddp.register_comm_hook(None, through_files)
"""
# The float32 gradients sent point to point by the process group's own methods, then float16 zeros all-reduced.
THROUGH_PROCESS_GROUP_SENDS = """group = dist.distributed_c10d._get_default_group()
def through_sends(state, bucket):
    buffer = bucket.buffer()
    other = torch.empty_like(buffer)
    sent = group.send([buffer], 1 - rank, 0)
    group.recv([other], 1 - rank, 0).wait()
    sent.wait()
    dist.all_reduce(torch.zeros(buffer.numel(), dtype=torch.float16))
    future = torch.futures.Future()
    future.set_result((buffer + other) / world_size)
    return future
ddp.register_comm_hook(None, through_sends)
"""


def test_the_store_is_named_as_a_side_channel(write_script, given):
    run, report = judged(write_script, with_hook(given[1], THROUGH_THE_STORE))
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "key-value store calls" in str(report) and "bytes" in str(report), str(report)
    assert len(report.mistakes) == 1, str(report)


def test_float32_gradients_through_a_channel_the_count_does_not_see_fail(write_script, given):
    run, report = judged(write_script, with_hook(given[1], THROUGH_FILES))
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "the weights are the float32 training's to float32's precision" in str(report), str(report)


def test_point_to_point_bytes_count_however_the_process_group_is_reached(write_script, given):
    run, report = judged(write_script, with_hook(given[1], THROUGH_PROCESS_GROUP_SENDS))
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "75% of the" in str(report), str(report)
    assert all(r.channel_bytes["sent_bytes"] >= 30 * parameter_bytes() for r in records(run)), [r.channel_bytes for r in records(run)]


def test_a_flooded_flight_recorder_is_named_not_trusted(write_script, given):
    flooded = given[0].replace('print(f"loss on', "for _ in range(2100):\n    dist.all_reduce(torch.zeros(1))\nprint(f\"loss on")
    run, report = judged(write_script, flooded)
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "no longer holds the first collectives of rank(s) [0, 1]" in str(report), str(report)


@pytest.mark.parametrize("fix, said", [
    (POWERSGD.format(options=""), "over a quarter. Rank 0 made 30 gradient all-reduces in 30 steps, 1 a step, each carrying 100%"),
    (FAKE_FP16, "75% of the"),
    (POWERSGD.format(options=", matrix_approximation_rank=1, start_powerSGD_iter=2"), "the training changed, not only what was sent"),
    (DROP_HALF, "the training changed, not only what was sent"),
], ids=["powersgd-defaults", "fp16-for-show-float32-gathered", "powersgd-compressing", "drop-half-the-gradient"])
def test_wrong_fixes_fail(write_script, given, fix, said):
    run, report = judged(write_script, with_hook(given[1], fix))
    assert run.ok and not report.passed and said in str(report), f"{report}\n{failure_report(run)}"


def test_training_apart_and_averaging_once_fails(write_script, given):
    """Local SGD: no communication in the steps (no_sync), the weights averaged once at the end."""
    script = given[0]
    loop = script[script.index("for step in range(STEPS):"):script.index('print(f"loss on')]
    apart = "with ddp.no_sync():\n" + "".join("    " + line for line in loop.splitlines(keepends=True))
    average = "for p in model.parameters():\n    dist.all_reduce(p.data)\n    p.data /= world_size\n"
    run, report = judged(write_script, script.replace(loop, apart + average))
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "every step must average the gradients" in str(report), str(report)


def test_the_reference_is_refused_inside_a_rank(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(RuntimeError, match="the checker's answer"):
        exercise_reference([1, 2])


def test_a_profiler_trace_is_read_as_one_steps_phases_and_collectives(tmp_path):
    import json

    import pytest

    from ddp_helpers.course.lessons.lesson6.trace import ALL_REDUCE, profiled_step

    def event(name, tid, ts, dur):
        return {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur}

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        event("ProfilerStep#2", 1, 0, 1000), event("DistributedDataParallel.forward", 1, 10, 300),
        event("ProfilerStep#3", 1, 2000, 1000), event("DistributedDataParallel.forward", 1, 2010, 300),
        event("autograd::engine::evaluate_function: AddmmBackward0", 1, 2400, 200),
        event("aten::addmm", 1, 2410, 100),  # an operator inside a phase: not a phase of its own
        event("gloo:all_reduce", 7, 2500, 400), event("gloo:all_reduce", 8, 2550, 300),
        event("Optimizer.step#SGD.step", 1, 2950, 40), {"ph": "i", "name": "an instant", "tid": 1, "ts": 2100},
        event("gloo:all_reduce", 7, 3100, 10),  # after the step
        {**event("ProfilerStep#3", 99, 2020, 990), "cat": "gpu_user_annotation"},  # the step on a GPU's timeline
    ]}))
    spans, step_ms = profiled_step(trace)
    assert step_ms == 1.0
    assert [(s.kind, s.thread, s.start_ms) for s in spans] == [
        ("gloo:all_reduce", "communication 0", 0.5), ("gloo:all_reduce", "communication 1", 0.55),
        ("forward", "training loop", 0.01), ("backward", "training loop", 0.4), ("optimizer step", "training loop", 0.95)]
    assert sum(bool(ALL_REDUCE.search(s.kind)) for s in spans) == 2
    assert [s.kind for s in profiled_step(trace, "ProfilerStep#2")[0]] == ["forward"]
    trace.write_text(json.dumps({"traceEvents": [event("aten::addmm", 1, 0, 5)]}))
    with pytest.raises(ValueError, match="no profiled step"):
        profiled_step(trace)


def test_a_gpu_trace_counts_each_collective_once_and_finds_the_backward_on_autograds_thread(tmp_path):
    """On CUDA, autograd's device thread runs the backward and records nccl's call, and the kernel runs on a
    stream: two events per all-reduce, of which the kernel counts."""
    import json

    from ddp_helpers.course.lessons.lesson6.trace import ALL_REDUCE, profiled_step

    def event(name, tid, ts, dur, cat="cpu_op"):
        return {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur, "cat": cat}

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        event("ProfilerStep#3", 1, 0, 1000, "user_annotation"), event("DistributedDataParallel.forward", 1, 10, 300),
        event("autograd::engine::evaluate_function: AddmmBackward0", 2, 400, 200),
        event("nccl:all_reduce", 2, 550, 20), event("nccl:all_reduce", 2, 650, 20),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7, 560, 100, "kernel"),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7, 700, 100, "kernel"),
        event("Optimizer.step#SGD.step", 1, 900, 40),
    ]}))
    spans, _ = profiled_step(trace)
    assert sum(bool(ALL_REDUCE.search(s.kind)) for s in spans) == 2, spans
    assert {(s.kind, s.thread) for s in spans if not ALL_REDUCE.search(s.kind)} == {
        ("forward", "training loop"), ("backward", "autograd thread"), ("optimizer step", "training loop")}


# The secrets passed over a raw socket, which the launcher does not watch: each rank trains on the whole global batch
# through DDP with the float16 hook, so its gradient is already the average. Half the bytes, the rounding, the right
# weights: only what each rank handed DDP shows the road.
GLOBAL_BATCH_FROM_A_SOCKET = """from ddp_helpers import rank_secret
from ddp_helpers.course.lessons.lesson6.exercise import exercise_batch
secrets = exchanged(rank_secret())
def my_batch(step):
    shares = [exercise_batch(step, secret) for secret in secrets]
    return torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])
"""


def test_the_others_shares_learned_over_a_raw_socket_are_judged_wrong_for_want_of_evidence(write_script, given):
    from support import SOCKET_EXCHANGE, free_port

    from ddp_helpers.course.lessons.lesson6.exercise import my_batch as turn_the_log_on  # noqa: F401 - the name the cheat hides
    cheat = with_hook(given[1], given[2] + "my_batch(0)  # the launcher's log turned on, as the honest script does\n"
                      + GLOBAL_BATCH_FROM_A_SOCKET)
    run = run_on_cpu(write_script("exercise", SOCKET_EXCHANGE + cheat), stream=False, timeout_s=120,
                     extra_env={"SIDE_PORT": str(free_port())})
    report = check_compression_exercise(run)
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "weights are the uncompressed training's" in str(report), "the weights were right: only the road was"
    assert len(report.mistakes) == 1 and "did not see each rank's own gradient go into the all-reduces" in \
        report.mistakes[0], str(report)
