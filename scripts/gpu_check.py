"""The GPU check: the course's nccl path on this machine's NVIDIA GPUs, with the torch installed here.
`scripts/gpu_check.sh` runs it (after installing the pure-Python packages it needs from a bundle of wheels,
offline); `python scripts/gpu_check.py` runs it where they are installed already.

It prints one line per check, then a summary. Exit code: 0 every check held, 1 one failed, 3 no GPU (it says
what it would run, and checks nothing).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
NO_GPU_EXIT = 3
LESSON_TIMEOUT_S = 600

# What runs, in order: printed as the plan where there is no GPU.
PLAN = (
    ("detection", "lesson 0's hardware detection: nccl chosen with 2 GPUs or more; with one, gloo by default "
                  "and --backend nccl -n 1 accepted"),
    ("warm launch", "a warm nccl launch (one rank per GPU, at most 2): an all_reduce on the GPUs, and the warm "
                    "process never initialised CUDA before the fork (torch.cuda._is_in_bad_fork() false)"),
    ("cold launch", "the same all_reduce launched cold (--cold)"),
    ("lessons 0-7", "with 2 GPUs or more: every lesson whole, as scripts/launch_lesson.sh N runs it (nccl by "
                    "default, the checks included); with one GPU: every %%torchrun cell whose world can be 1, "
                    "on nccl at world 1 (--backend nccl -n 1), without the checks that need 2 ranks"),
    ("exercise checker", "lesson 0's exercise on nccl (and again on 3 CPU ranks): the solution judged right, the cell as given judged wrong "
                         "(2 GPUs or more)"),
    ("hang report", "a rank that skips an all_reduce on nccl: the report names the collective and the rank, "
                    "with stacks (2 GPUs or more)"),
    ("all-reduce benchmark", "benchmarks/allreduce.py on nccl, up to 64 MiB (2 GPUs or more)"),
    ("straggler timing", "rank 1 does ~0.2 s of GPU work before an all_reduce: on rank 0, wait() returns to the host "
                         "at once (nccl: the stream waits) and only torch.cuda.synchronize() takes the straggler's "
                         "time, as lessons 5 and 7 say (2 GPUs or more)"),
    ("MFU against the GPU's peak", "a bfloat16 training step of dense layers, FLOPs counted by torch and timed with "
                                   "CUDA events, over the datasheet peak of a GPU the check knows (H100, H200): an "
                                   "MFU between 0 and 100 %, as lesson 6 computes it"),
)
# Datasheet dense bfloat16 peaks (NVIDIA's H100 and H200 SXM data sheets: 989 TFLOPS without sparsity), by the
# name torch.cuda.get_device_name() gives; another GPU's MFU is not computed (no guessed peak).
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}

results: list[tuple[str, bool | None, str]] = []  # (check, held / failed / skipped, detail)


def report(check: str, held: bool | None, detail: str) -> None:
    mark = {True: "✓", False: "✗", None: "–"}[held]
    results.append((check, held, detail))
    print(f"{mark} {check}: {detail}", flush=True)


def write(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


ALL_REDUCE = """
    import os
    import torch
    import torch.distributed as dist
    from ddp_helpers import record

    record("bad_fork", torch.cuda._is_in_bad_fork())  # True where the parent had initialised CUDA (torch/cuda/__init__.py)
    record("initialised_at_start", torch.cuda.is_initialized())
    record("parent", os.getppid())  # the warm process, where the launch was warm
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    value = torch.full((1,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(value)
    record("sum", value.item())
    record("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    dist.destroy_process_group()
"""

HANG = """
    import os
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=60))
    value = torch.ones(4, device=device)
    dist.all_reduce(value)
    if dist.get_rank() == 0:
        dist.all_reduce(value)  # rank 1 never calls this one
        value.cpu()  # waits for it on a GPU too
    else:
        import time
        time.sleep(120)
"""


def check_detection(gpus: int) -> None:
    from ddp_helpers.default_job import detect_hardware
    from ddp_helpers import make_launch_config

    hardware = detect_hardware()
    expected = "nccl" if gpus >= 2 else "gloo"
    report("detection", hardware.default_backend == expected,
           f"{hardware.describe()}; default backend {hardware.default_backend!r} (expected {expected!r})")
    if gpus == 1:
        try:
            config = make_launch_config(PROJECT / "scripts" / "gpu_check.py", nproc=1, backend="nccl")
            report("detection", config.backend == "nccl", "--backend nccl -n 1 is accepted on one GPU")
        except Exception as error:  # noqa: BLE001 - the check reports whatever refused it
            report("detection", False, f"--backend nccl -n 1 refused: {error}")


def check_all_reduce(folder: Path, world: int, cold: bool, backend: str = "nccl") -> None:
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.engines.local import warm
    from ddp_helpers.default_job import prepare_warm_launches

    name = "cold launch" if cold else "warm launch"
    if not cold and not prepare_warm_launches():
        report(name, False, "the warm process did not start")
        return
    script = write(folder, f"all_reduce_{'cold' if cold else 'warm'}.py", ALL_REDUCE)
    run = launch(make_launch_config(script, nproc=world, backend=backend, cold=cold, stream=False, timeout_s=180))
    if not run.ok:
        report(name, False, f"the run failed: {run.summary()}")
        return
    expected = world * (world + 1) / 2
    sums, bad_fork = run.facts("sum"), run.facts("bad_fork")
    forked = run.facts("parent") == [warm._ZYGOTE.process.pid] * world if not cold else True
    held = (all(abs(s - expected) < 1e-6 for s in sums) and not any(bad_fork)
            and not any(run.facts("initialised_at_start")) and forked)
    report(name, held, f"{world} rank(s) on {run.ranks[0].facts['device']}"
                       + ("" if cold else f", forked from the warm process: {forked}")
                       + f"; all_reduce gave {sums} (expected {expected:g} each); CUDA initialised before the "
                         f"fork: {any(bad_fork)}")


def run_whole_lesson(key: str) -> tuple[bool, str]:
    process = subprocess.run([sys.executable, "-m", "ddp_helpers.course.lesson_runner", key], cwd=PROJECT,
                             capture_output=True, text=True, timeout=LESSON_TIMEOUT_S)
    last = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()][-1:]
    return process.returncode == 0, (last[0] if last else "")


def run_cells_at_world_one(notebook: Path, backend: str = "nccl", shell=None) -> tuple[int, list[str], list[int]]:
    """Every %%torchrun cell of the lesson whose options allow one rank, at world 1; the checks between them are
    left out (they count two ranks or more). A cell that fails is run again on gloo at world 1: where it fails
    there too, it needs 2 ranks (a two-stage pipeline, FSDP's collectives), which is no fault of the GPU path.
    Returns how many ran, the failures, and the cells that need 2 ranks. `shell`: IPython's shell to run them
    in (default: the process's own; IPython allows one kind of shell per process)."""
    import nbformat
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = shell or InteractiveShell.instance()
    if "ddp_helpers" not in shell.extension_manager.loaded:
        shell.run_line_magic("load_ext", "ddp_helpers")

    def run_at_world_one(options: list[str], body: str, on: str):
        with capture_output() as captured:  # one line per lesson here, not every rank's output
            result = shell.run_cell(f"%%torchrun --backend {on} -n 1 {shlex.join(options)}\n{body}")
        said = [line.strip() for line in (captured.stdout + captured.stderr).splitlines() if line.strip()]
        return result.success, (said[-1] if said else repr(result.error_in_exec))

    ran, failures, need_two = 0, [], []
    for index, cell in enumerate(c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"):
        first, _, body = cell.source.partition("\n")
        tags = set(cell.metadata.get("tags", []))
        if not first.startswith("%%torchrun") or tags & {"raises-exception", "skip-execution"}:
            continue
        options = shlex.split(first)[1:]
        if set(options) & {"--nnodes", "--slurm", "--kill-rank", "--join-after", "--may-fail"}:
            continue  # several machines, a cluster, a rank killed or joining, a failure shown on purpose
        for flag in ("-n", "--nproc", "--backend"):  # the cell's world and backend give way to world 1
            while flag in options:
                at = options.index(flag)
                del options[at:at + 2]
        ran += 1
        succeeded, last_line = run_at_world_one(options, body, backend)
        if succeeded:
            continue
        if backend != "gloo" and not run_at_world_one(options, body, "gloo")[0]:
            need_two.append(index + 1)
        else:
            failures.append(f"code cell {index + 1}: {last_line}"[:300])
    return ran, failures, need_two


def check_lessons(gpus: int) -> None:
    from ddp_helpers.course.lesson_runner import available_lessons

    for number, notebook in available_lessons().items():
        started = time.monotonic()
        if gpus >= 2:
            held, last = run_whole_lesson(number)
            report(f"lesson {number}", held, f"whole lesson in {time.monotonic() - started:.0f} s: {last}")
        else:
            ran, failures, need_two = run_cells_at_world_one(notebook)
            report(f"lesson {number}", not failures,
                   f"{ran - len(failures) - len(need_two)} of {ran} %%torchrun cells ran on nccl at world 1"
                   + (f"; {len(need_two)} need 2 ranks (code cells {', '.join(map(str, need_two))}: they fail on "
                      "gloo at world 1 too)" if need_two else "")
                   + (f"; failed: {'; '.join(failures)}" if failures else ""))


def check_exercise(folder: Path, gpus: int, backend: str = "nccl") -> None:
    if gpus < 2:
        report("exercise checker", None, "needs 2 GPUs")
        return
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.course import keep_records
    from ddp_helpers.course.lessons.lesson0 import check_mean_exercise

    keep_records()  # the records the checker judges a run by, as a lesson's first cell turns them on

    preamble = """
        import os
        import torch
        import torch.distributed as dist
        from ddp_helpers import record
        from ddp_helpers.course.lessons.lesson0 import my_number

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        number = torch.tensor([my_number()], device="cuda" if cuda else "cpu")
    """
    solution = preamble + """
        mean = number.clone()
        dist.all_reduce(mean)
        mean /= world_size
        record("mean", mean.item())
        dist.destroy_process_group()
    """
    as_given = preamble + """
        mean = number
        record("mean", mean.item())
        dist.destroy_process_group()
    """
    verdicts = {}
    for name, body in (("solution", solution), ("as_given", as_given)):
        script = write(folder, f"exercise_{name}.py", body)
        run = launch(make_launch_config(script, nproc=2, backend=backend, stream=False, timeout_s=180))
        verdicts[name] = check_mean_exercise(run)
    right, wrong = not verdicts["solution"].mistakes, bool(verdicts["as_given"].mistakes)
    report("exercise checker", right and wrong,
           f"the solution judged {'right' if right else 'wrong: ' + '; '.join(verdicts['solution'].mistakes)}, "
           f"the cell as given judged {'wrong' if wrong else 'right'}")


def check_hang_report(folder: Path, gpus: int, backend: str = "nccl", timeout_s: float = 30) -> None:
    """A rank that never calls the all_reduce the other waits in: the report names it. `timeout_s`: room for a
    first CUDA start on a GPU (the suite's CPU run, warm, needs less)."""
    if gpus < 2:
        report("hang report", None, "needs 2 GPUs (nccl cannot put two ranks on one GPU)")
        return
    from ddp_helpers import launch, make_launch_config

    run = launch(make_launch_config(write(folder, "hang.py", HANG), nproc=2, backend=backend, stream=False,
                                    timeout_s=timeout_s))
    cause = run.hang.cause if run.hang else ""
    report("hang report", bool(run.timed_out and run.hang and "all_reduce" in cause and "1" in cause),
           f"timed out: {run.timed_out}; the report says: {cause or 'nothing'}")


STRAGGLER = """
    import os, time
    import torch
    import torch.distributed as dist
    from ddp_helpers import record

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    value, matrix = torch.ones(1 << 20, device=device), torch.randn(4096, 4096, device=device)
    dist.all_reduce(value)  # nccl's communicators made before anything is timed
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if dist.get_rank() == 1:  # the straggler: queued GPU work, the host goes straight on
        for _ in range(200):
            matrix = matrix @ matrix.T / 4096
    end.record()
    began = time.perf_counter()
    dist.all_reduce(value, async_op=True).wait()  # nccl: the current stream waits; the host does not
    host_wait = time.perf_counter() - began
    torch.cuda.synchronize()  # the host waits until the GPU has finished the all-reduce
    synchronized = time.perf_counter() - began
    record("timing", {"gpu_work_ms": start.elapsed_time(end), "host_wait_ms": 1e3 * host_wait,
                      "synchronized_ms": 1e3 * synchronized})
    dist.destroy_process_group()
"""


def check_straggler_timing(folder: Path, gpus: int) -> None:
    if gpus < 2:
        report("straggler timing", None, "needs 2 GPUs")
        return
    from ddp_helpers import launch, make_launch_config

    run = launch(make_launch_config(write(folder, "straggler.py", STRAGGLER), nproc=2, backend="nccl", stream=False,
                                    timeout_s=180))
    if not run.ok:
        report("straggler timing", False, f"the run failed: {run.summary()}")
        return
    fast, slow = run.ranks[0].facts["timing"], run.ranks[1].facts["timing"]
    held = (fast["host_wait_ms"] < 0.2 * fast["synchronized_ms"]
            and fast["synchronized_ms"] > 0.5 * slow["gpu_work_ms"])
    report("straggler timing", held,
           f"rank 1's GPU work {slow['gpu_work_ms']:.0f} ms; on rank 0, wait() returned after "
           f"{fast['host_wait_ms']:.2f} ms and torch.cuda.synchronize() after {fast['synchronized_ms']:.0f} ms")


def check_mfu(gpus: int) -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in BF16_PEAK_FLOPS.items() if key in name), None)
    if peak is None:
        report("MFU against the GPU's peak", None, f"no datasheet peak known here for {name}")
        return
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, dtype=torch.bfloat16) for _ in range(4)]).cuda()
    batch = torch.randn(4096, 8192, dtype=torch.bfloat16, device="cuda")
    with FlopCounterMode(display=False) as counter:
        model(batch).float().square().mean().backward()
    flops = counter.get_total_flops()
    for _ in range(3):  # warm-up
        model(batch).float().square().mean().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    steps = 10
    for _ in range(steps):
        model(batch).float().square().mean().backward()
    end.record()
    host_only = time.perf_counter() - began  # before any wait: the kernels were only queued
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    mfu, unsynchronized = flops * steps / seconds / peak, flops * steps / host_only / peak
    report("MFU against the GPU's peak", 0 < mfu <= 1,
           f"{name}: {flops * steps / seconds / 1e12:.0f} TFLOP/s of bf16 dense {peak / 1e12:.0f}: MFU {mfu:.0%} "
           f"(timed on the host without a synchronize it would read {unsynchronized:.0%})")


def check_benchmark(gpus: int) -> None:
    if gpus < 2:
        report("all-reduce benchmark", None, "needs 2 GPUs")
        return
    process = subprocess.run([sys.executable, str(PROJECT / "benchmarks" / "allreduce.py"), "--max-mib", "64"],
                             cwd=PROJECT, capture_output=True, text=True, timeout=LESSON_TIMEOUT_S)
    print(textwrap.indent(process.stdout.strip(), "    "), flush=True)
    report("all-reduce benchmark", process.returncode == 0, f"exit code {process.returncode}")


def main() -> int:
    import torch

    from ddp_helpers.torch_compat import report as torch_report

    gpus = torch.cuda.device_count()
    print(torch_report())
    if gpus == 0:
        print("No NVIDIA GPU found here (torch.cuda.device_count() is 0, torch built for "
              f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'}): nothing was checked. "
              "On a machine with GPUs this check runs:")
        for check, what in PLAN:
            print(f"  - {check}: {what}")
        return NO_GPU_EXIT
    print(f"{gpus} GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}, nccl "
          f"{'.'.join(map(str, torch.cuda.nccl.version()))}\n", flush=True)
    world = min(gpus, 2)
    with tempfile.TemporaryDirectory(prefix="ddp-gpu-check-") as scratch:
        folder = Path(scratch)
        steps = [lambda: check_detection(gpus), lambda: check_all_reduce(folder, world, cold=False),
                 lambda: check_all_reduce(folder, world, cold=True), lambda: check_lessons(gpus),
                 lambda: check_exercise(folder, gpus), lambda: check_hang_report(folder, gpus),
                 lambda: check_benchmark(gpus), lambda: check_straggler_timing(folder, gpus),
                 lambda: check_mfu(gpus)]
        for (check, _), step in zip(PLAN, steps):
            try:
                step()
            except Exception as error:  # noqa: BLE001 - one broken check must not hide the others
                report(check, False, f"{type(error).__name__}: {error}")
    failed = [r for r in results if r[1] is False]
    held = [r for r in results if r[1] is True]
    skipped = [r for r in results if r[1] is None]
    print(f"\nSummary: {len(held)} held, {len(failed)} failed, {len(skipped)} skipped, on {gpus} GPU(s) with torch "
          f"{torch.__version__}." + (f" Failed: {', '.join(r[0] for r in failed)}." if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
