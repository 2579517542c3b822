"""Lesson 7's exercise (MyDDP, bucketed and overlapped): the solution passes, and each wrong fix fails with a
hint that names its mistake. Every run is a real 2-rank launch on CPU; the checker reads its flight recorder."""

import pytest

from ddp_helpers.course.lessons.lesson7.checker import accepted_buckets, check_my_ddp_exercise, wrapped_torch_ddp
from ddp_helpers.course.lessons.lesson7.exercise import BUCKET_CAP_BYTES, STEPS, plain_model
from support import exercise_cells, failure_report, run_on_cpu

CLASS_START = "class MyDDP(torch.nn.Module):"


@pytest.fixture(scope="module")
def given():
    _, script, (solution,) = exercise_cells("07_build_your_own_ddp.ipynb")
    start, end = script.index(CLASS_START), script.index("\n\n\nmodel = ")
    return script[:start], solution.strip("\n"), script[end:]


def judged(write_script, given, my_ddp: str, second_world: bool = False):
    """The checker's report on the given script with `my_ddp` for its class. The checker's second run, on 3
    ranks, only where a test asks for it: it runs when everything else passed, and one test is enough."""
    head, _, tail = given
    run = run_on_cpu(write_script("exercise", head + my_ddp + tail), stream=False, timeout_s=120)
    assert run.ok, failure_report(run)
    return check_my_ddp_exercise(run, second_world=second_world)


def test_the_two_readings_of_a_cap_make_different_buckets_of_the_same_values():
    readings = list(accepted_buckets().values())
    assert readings[0] != readings[1] and sum(readings[0]) == sum(readings[1])
    assert all(1 < len(buckets) < 8 for buckets in readings)  # neither one per parameter nor one for the model


def test_the_solution_passes_at_two_world_sizes(write_script, given):
    report = judged(write_script, given, given[1], second_world=True)
    assert report.passed, str(report)
    assert "and again on 3 ranks" in str(report) and "carried its own batch's gradients" in str(report)
    assert "3 buckets a step" in str(report) and "ran while it went on computing gradients" in str(report)


NEVER_OVER_THE_CAP = ("""            current.append(parameter)
            size += parameter.numel() * parameter.element_size()
            if size >= bucket_cap_bytes:  # as torch DDP: a bucket closes once it holds the cap
                self.buckets.append(current)
                current, size = [], 0""", """            nbytes = parameter.numel() * parameter.element_size()
            if current and size + nbytes > bucket_cap_bytes:  # never over the cap
                self.buckets.append(current)
                current, size = [], 0
            current.append(parameter)
            size += nbytes""")


def test_buckets_never_over_the_cap_pass_too(write_script, given):
    report = judged(write_script, given, given[1].replace(*NEVER_OVER_THE_CAP))
    assert report.passed, str(report)
    assert "never-over-the-cap rule" in str(report)


# As DDP does: the backward's first gradient queues the end of the backward on the autograd engine, which waits for every
# bucket and copies the averages back, so backward() returns with them; the loop's own call then finds nothing left.
WAIT_QUEUED_ON_THE_ENGINE = ("""        if self.ready[id(bucket)] == len(bucket):  # the bucket's last gradient: send it now""",
                             """        if not getattr(self, "queued", False):  # the backward's first gradient: its end waits
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: (self.finish_gradient_synchronization(), setattr(self, "queued", False)))
        if self.ready[id(bucket)] == len(bucket):  # the bucket's last gradient: send it now""")


def test_the_wait_queued_on_the_autograd_engine_passes(write_script, given):
    assert WAIT_QUEUED_ON_THE_ENGINE[0] in given[1]
    report = judged(write_script, given, given[1].replace(*WAIT_QUEUED_ON_THE_ENGINE))
    assert report.passed, str(report)


def test_an_all_reduce_then_divide_route_passes(write_script, given):
    solution = given[1].replace(
        "flat = torch.cat([p.grad.flatten() for p in bucket]) / dist.get_world_size()",
        "flat = torch.cat([p.grad.flatten() for p in bucket])").replace(
        "            handle.wait()\n", "            handle.wait()\n            flat /= dist.get_world_size()\n")
    assert solution != given[1]
    report = judged(write_script, given, solution)
    assert report.passed, str(report)


WRAPPED_IN_TORCH_DDP = '''class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel
        self.inner = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_bytes / 2**20)

    def forward(self, *inputs):
        return self.inner(*inputs)

    def finish_gradient_synchronization(self):
        pass'''

ONE_FLAT_ALL_REDUCE_AFTER_BACKWARD = '''class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        grads = [p.grad for p in self.module.parameters()]
        flat = torch.cat([g.flatten() for g in grads]) / dist.get_world_size()
        dist.all_reduce(flat)
        for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(averaged.view_as(g))'''

PER_PARAMETER_ALL_REDUCES = '''class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        self.handles = []
        for parameter in module.parameters():
            parameter.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, parameter):
        parameter.grad /= dist.get_world_size()
        self.handles.append(dist.all_reduce(parameter.grad, async_op=True))

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        for handle in self.handles:
            handle.wait()
        self.handles.clear()'''

BUCKETS_AFTER_BACKWARD = '''class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        self.buckets, current, size = [], [], 0
        for parameter in reversed(list(module.parameters())):
            current.append(parameter)
            size += parameter.numel() * parameter.element_size()
            if size >= bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        for bucket in self.buckets:
            flat = torch.cat([p.grad.flatten() for p in bucket]) / dist.get_world_size()
            dist.all_reduce(flat)
            for parameter, averaged in zip(bucket, flat.split([p.numel() for p in bucket])):
                parameter.grad.copy_(averaged.view_as(parameter.grad))'''


@pytest.mark.parametrize("name, change, said", [
    ("torch's DDP inside, without its check at the wrap", lambda solution: WRAPPED_IN_TORCH_DDP.replace(
        "bucket_cap_mb=bucket_cap_bytes / 2**20)", "bucket_cap_mb=bucket_cap_bytes / 2**20, init_sync=False)"),
     "used torch's DistributedDataParallel"),
    ("every rank's batch gathered at the start", lambda solution: solution.replace(
        "        self.module = module\n",
        "        self.module = module\n        from ddp_helpers import rank_secret\n"
        "        self.secrets = [None] * dist.get_world_size()\n"
        "        dist.all_gather_object(self.secrets, rank_secret())\n", 1),
     "data crossed between the ranks outside the gradients' buckets"),
    ("one flat all-reduce after backward", lambda solution: ONE_FLAT_ALL_REDUCE_AFTER_BACKWARD,
     "the whole model at once"),
    ("per-parameter all-reduces", lambda solution: PER_PARAMETER_ALL_REDUCES, "one per parameter"),
    ("buckets after the backward", lambda solution: BUCKETS_AFTER_BACKWARD, "nothing overlapped"),
    ("a sum, not an average", lambda solution: solution.replace(" / dist.get_world_size()", ""),
     "summed their gradients and did not average"),
    ("no wait()", lambda solution: solution.replace("            handle.wait()\n", ""),
     "before every all-reduce of the step had been waited for"),
    ("only the last bucket waited for", lambda solution: solution.replace(
        "        for handle, flat, bucket in self.launched:\n            handle.wait()\n",
        "        self.launched[-1][0].wait()\n        for handle, flat, bucket in self.launched:\n"),
     "before every all-reduce of the step had been waited for"),
    ("a wait in the hook", lambda solution: solution.replace(
        "            self.launched.append((dist.all_reduce(flat, async_op=True), flat, bucket))\n",
        "            self.launched.append((dist.all_reduce(flat, async_op=True), flat, bucket))\n"
        "            self.launched[-1][0].wait()\n"), "the backward stood still while each one ran"),
])
def test_wrong_fixes_fail_with_a_hint_that_names_the_mistake(write_script, given, name, change, said):
    wrong = change(given[1])
    assert wrong != given[1]
    report = judged(write_script, given, wrong)
    assert not report.passed and said in str(report), f"{name}:\n{report}"


def test_the_buckets_the_checker_expects_fit_the_cap():
    for buckets in accepted_buckets().values():
        assert sum(buckets) == sum(p for p in [2048, 64, 4096, 64, 4096, 64, 64, 1])
    assert BUCKET_CAP_BYTES == 16 * 1024 and STEPS >= 10


def test_one_bucket_in_flight_at_a_time_still_overlaps(write_script, given):
    # Waiting for the previous bucket when the next one is launched bounds the memory in flight: each bucket
    # still runs while the backward computes the next one's gradients.
    solution = given[1].replace(
        "            self.launched.append((dist.all_reduce(flat, async_op=True), flat, bucket))\n",
        "            if self.launched:\n                self.launched[-1][0].wait()\n"
        "            self.launched.append((dist.all_reduce(flat, async_op=True), flat, bucket))\n")
    assert solution != given[1]
    report = judged(write_script, given, solution)
    assert report.passed, str(report)


ZERO_BUCKETS_FOR_SHOW = '''class MyDDP(torch.nn.Module):
    """Buckets of zeros sent for show; every rank's gradient computed here from every rank's secret."""

    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module, self.step, self.handles = module, 0, []
        self.buckets, current, size = [], [], 0
        for parameter in reversed(list(module.parameters())):
            current.append(parameter)
            size += parameter.numel() * parameter.element_size()
            if size >= bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {parameter: bucket for bucket in self.buckets for parameter in bucket}
        self.ready = {id(bucket): 0 for bucket in self.buckets}
        for parameter in module.parameters():
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, parameter):
        bucket = self.bucket_of[parameter]
        self.ready[id(bucket)] += 1
        if self.ready[id(bucket)] == len(bucket):
            self.ready[id(bucket)] = 0
            zeros = torch.zeros(sum(p.numel() for p in bucket))
            self.handles.append(dist.all_reduce(zeros, async_op=True))

    def forward(self, *inputs):
        return self.module(*inputs)

    def finish_gradient_synchronization(self):
        import subprocess, sys
        from ddp_helpers.course.lessons.lesson7.exercise import exercise_batch

        world = dist.get_world_size()
        if not hasattr(self, "secrets"):  # read by another program: the launcher sees only this process's opens
            self.secrets = [int(subprocess.run(
                [sys.executable, "-c", f"from ddp_helpers.run_folder import RunFolder as F; from ddp_helpers.course.records "
                                       f"import read_secret; print(read_secret(F.from_environment(), {rank}))"],
                capture_output=True, text=True, check=True).stdout) for rank in range(world)]
        parameters = list(self.module.parameters())
        total = [torch.zeros_like(p) for p in parameters]
        for rank in range(world):
            inputs, targets = exercise_batch(self.step, self.secrets[rank])
            loss = torch.nn.functional.mse_loss(self.module(inputs), targets)
            for t, g in zip(total, torch.autograd.grad(loss, parameters)):
                t += g / world
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
        for p, t in zip(parameters, total):
            p.grad.copy_(t)
        self.step += 1'''


def test_buckets_sent_for_show_fail_though_the_weights_are_right(write_script, given):
    # A rank that reads every rank's secret from the run folder (through another program, which the launcher
    # does not watch) can compute the whole batch's gradient itself; its buckets' all-reduces then carry zeros.
    # The weights are right: what the buckets carried is not.
    report = judged(write_script, given, ZERO_BUCKETS_FOR_SHOW)
    assert not report.passed and "not its own batch's gradients" in str(report), str(report)
    assert "weights, those of one process" in str(report), str(report)


def test_an_average_hard_wired_for_two_ranks_fails_on_three(write_script, given):
    hard_wired = given[1].replace(" / dist.get_world_size()", " * 0.5")
    assert hard_wired != given[1]
    report = judged(write_script, given, hard_wired, second_world=True)
    assert not report.passed and "run again by the checker on 3 ranks" in str(report), str(report)


def test_torch_ddps_check_at_the_wrap_is_recognised_in_the_flight_recorder():
    # What torch DDP's wrap puts in the flight recorder (run on gloo, torch 2.10 to 2.13): the parameter count
    # all-gathered, then the shapes broadcast, then rank 0's weights.
    wrap = [{"op": "all_gather", "shapes": [[1]], "dtypes": ["long"]}, {"op": "broadcast", "shapes": [[6]], "dtypes": ["long"]},
            {"op": "broadcast", "shapes": [[20]], "dtypes": ["float"]}]
    assert wrapped_torch_ddp(wrap)
    assert not wrapped_torch_ddp(wrap[2:]) and not wrapped_torch_ddp([{"op": "all_reduce", "shapes": [[1]], "dtypes": ["long"]}])


def test_buckets_filled_in_forward_order_are_neither_reading_of_the_cap():
    sizes = [p.numel() for p in plain_model().parameters()]
    forward, bucket, size = [], 0, 0
    for numel in sizes:
        bucket, size = bucket + numel, size + numel * 4
        if size >= BUCKET_CAP_BYTES:
            forward.append(bucket)
            bucket = size = 0
    forward += [bucket] if bucket else []
    assert all(sorted(forward) != sorted(buckets) for buckets in accepted_buckets().values())
