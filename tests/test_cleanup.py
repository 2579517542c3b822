"""Stopping the launching process mid-run leaves no process and no listening port behind, within the
bound the README states (default_job.STOP_BOUND_S).

The launcher runs in a child Python process, as it does in a Jupyter kernel: SIGINT is what the
notebook's stop button sends (pressed once, or twice in a second); SIGKILL is how Jupyter ends a
kernel that is restarted or shut down. The ranks make it hard: each has children of its own (a
subprocess and a forked process, as DataLoader workers are), and rank 1 ignores SIGTERM.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from ddp_helpers.default_job import STOP_BOUND_S
from ddp_helpers.processes import process_is_dead
from support import DAEMON_SOURCE, listening_ports, processes_left

LAUNCHING_PROCESS = textwrap.dedent(
    """
    import signal
    import sys
    # The stop button is SIGINT, which a Jupyter kernel always handles, whatever started the tests (a
    # background job of a script starts with SIGINT ignored, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.engines.local import warm
    from ddp_helpers.default_job import Hardware
    from ddp_helpers.default_job import prepare_warm_launches
    script, marker, run_dir, nproc, how, nnodes = sys.argv[1:7]
    if how == "warm":
        assert prepare_warm_launches(), "the warm process did not start"
        print("ZYGOTE", warm._ZYGOTE.process.pid, warm._ZYGOTE.folder, flush=True)
    config = make_launch_config(script, nproc=int(nproc), nnodes=int(nnodes), backend="gloo", hardware=Hardware(()),
                                run_dir=run_dir, extra_env={"TEST_MARK": marker}, stream=False, cold=how == "cold")
    try:
        launch(config)
    except KeyboardInterrupt:
        print("launcher saw KeyboardInterrupt", flush=True)
        sys.exit(130)
    """
)

STUBBORN_WORKER = textwrap.dedent(
    """
    import multiprocessing, os, signal, subprocess, time
    import torch.distributed as dist
    from ddp_helpers import record
    if os.environ["RANK"] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that will not stop when asked
    dist.init_process_group("gloo")
    sleeper = subprocess.Popen(["sleep", "300"])
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    forked.start()
    """
) + DAEMON_SOURCE + textwrap.dedent(
    """
    daemon_file = f"daemon{os.environ['RANK']}.pid"
    dist.barrier()
    record("children", [sleeper.pid, forked.pid, int(open(daemon_file).read())])
    record("rank_and_parent", [os.getpid(), os.getppid()])
    record("store_port", int(os.environ["MASTER_PORT"]))
    time.sleep(300)
    """
)


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")


def start_launcher(tmp_path, script_source: str, nproc: int, how: str = "cold", nnodes: int = 1):
    marker = uuid.uuid4().hex
    worker = tmp_path / "worker.py"
    worker.write_text(script_source)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING_PROCESS, str(worker), marker, str(run_dir), str(nproc), how, str(nnodes)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return launcher, marker, run_dir


@pytest.mark.parametrize(
    "signals, how, nnodes",
    [([signal.SIGINT], "cold", 1), ([signal.SIGINT, signal.SIGINT], "cold", 1), ([signal.SIGKILL], "cold", 1),
     ([signal.SIGINT, signal.SIGINT], "warm", 1), ([signal.SIGKILL], "warm", 1),
     ([signal.SIGKILL], "cold", 2), ([signal.SIGINT, signal.SIGINT], "warm", 2)],
    ids=["stop button", "stop button twice", "kernel killed", "warm: stop button twice", "warm: kernel killed",
         "2 agents: kernel killed", "2 agents, warm: stop button twice"],
)
def test_stopping_the_launcher_leaves_nothing_behind(tmp_path, signals, how, nnodes):
    launcher, marker, run_dir = start_launcher(tmp_path, STUBBORN_WORKER, nproc=2, how=how, nnodes=nnodes)
    world = range(2 * nnodes)
    try:
        facts = run_dir / "facts"
        try:
            wait_until(lambda: all((facts / f"rank{r}" / "store_port.json").exists() for r in world)
                       or launcher.poll() is not None, 60, "every rank joined the group and started its children")
            assert launcher.poll() is None, "the launching process ended before the ranks were up"
        except AssertionError as error:  # say why: the launcher's and the ranks' own words
            launcher.kill()
            ranks_said = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
                                   for p in sorted(run_dir.glob("rank*.std*")) + sorted(run_dir.glob("*.log")))
            raise AssertionError(f"{error}\n--- launcher ---\n{launcher.communicate()[0]}\n{ranks_said}") from None
        port = json.loads((facts / "rank1" / "store_port.json").read_text())
        children = [pid for r in world for pid in json.loads((facts / f"rank{r}" / "children.json").read_text())]
        ranks = [json.loads((facts / f"rank{r}" / "rank_and_parent.json").read_text()) for r in world]
        assert port in listening_ports(), "the rendezvous store should listen while the run is up"
        if how == "cold":  # the supervisor (with nnodes - 1 more agents), the ranks, 3 children each
            assert len(processes_left("TEST_MARK", marker)) >= nnodes + 4 * len(world)
        else:  # a warm rank's /proc environ is the zygote's: follow the pids instead
            zygote_pid, zygote_folder = launcher.stdout.readline().split()[1:]
            assert all(parent == int(zygote_pid) for _, parent in ranks), "the ranks should be warm"
        everything = children + [pid for pid, _ in ranks]

        stopped_at = time.monotonic()
        for how in signals:
            launcher.send_signal(how)
            time.sleep(0.3)
        try:
            wait_until(lambda: not processes_left("TEST_MARK", marker) and all(map(process_is_dead, everything)),
                       STOP_BOUND_S, "every process of the run is gone")
        except AssertionError as error:
            left = processes_left("TEST_MARK", marker) + [pid for pid in everything if not process_is_dead(pid)]
            raise AssertionError(f"{error}; left: {[describe(pid) for pid in left]}") from None
        wait_until(lambda: port not in listening_ports(), STOP_BOUND_S - (time.monotonic() - stopped_at),
                   f"port {port} is closed")
        output, _ = launcher.communicate(timeout=30)
        if signals[0] == signal.SIGINT:
            assert "launcher saw KeyboardInterrupt" in output
            assert launcher.returncode == 130, output
        if how == "warm":  # the warm process ends with the launching process, leaving nothing
            wait_until(lambda: process_is_dead(int(zygote_pid)) and not os.path.exists(zygote_folder),
                       STOP_BOUND_S, "the warm process is gone with its folder")
    finally:
        launcher.kill()
        launcher.wait()


STARTING_WORKER = textwrap.dedent(
    """
    import time
    time.sleep(300)
    """
)


def test_a_kernel_killed_while_ranks_start_leaves_no_rank(tmp_path):
    """Killed the moment the first rank process exists: ranks still starting must not be orphaned."""
    for attempt in range(3):
        scratch = tmp_path / f"try{attempt}"
        scratch.mkdir()
        launcher, marker, _ = start_launcher(scratch, STARTING_WORKER, nproc=4)

        def a_rank_started():
            return [pid for pid in processes_left("TEST_MARK", marker)
                    if b"ddp_helpers._bootstrap" in _cmdline(pid) and b"ddp_helpers.engines.local.supervisor" not in _cmdline(pid)]

        try:
            wait_until(a_rank_started, 60, "a rank process exists")
            launcher.kill()
            wait_until(lambda: not processes_left("TEST_MARK", marker), STOP_BOUND_S,
                       f"attempt {attempt}: every process of the run is gone")
        finally:
            launcher.kill()
            launcher.wait()


def describe(pid: int) -> str:
    """A live process, as far as /proc tells: for assertion messages."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)
        comm = fields[0].split(" (", 1)[1]
        state, ppid, pgrp, session = fields[1].split()[:4]
        return f"{pid} {comm!r} state {state} parent {ppid} group {pgrp} session {session} {_cmdline(pid)[:80]!r}"
    except OSError:
        return f"{pid} (gone)"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
