"""The real `torchrun` command, run as a terminal would run it, not through this course's launcher.

Lessons 4 and 5 use it to show torchrun's own behaviour (a port collision, c10d's numbering of
machines, a rendezvous that never completes, per-rank log files) and to look at a live job from
outside (`py-spy dump`). Every process a command starts carries a marker in its environment, so that
everything is killed when the cell is done with it, the ranks included.

It runs as `python -m ddp_helpers.guarded_torchrun`: the real torchrun, except that every store its agents
host listens on loopback only and their rendezvous state is signed with a key the job's agents share
(`store_guard`). Plain torchrun's stores listen on every interface, and its c10d rendezvous unpickles
whatever the store holds: on a shared machine another user could run code as you through it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ...guarded_torchrun import KEY_ENV
from ...python_command import python_module_command

MARKER_ENV = "DDP_LESSONS_TORCHRUN_COMMAND"


@contextlib.contextmanager
def torchrun_in_background(arguments: list[str], marker: str | None = None,
                           extra_env: dict[str, str] | None = None, job_key: str | None = None) -> Iterator[subprocess.Popen]:
    """Start `torchrun ARGUMENTS`, as in a second terminal (with `extra_env` exported), and yield its
    process (output on `.stdout`, text). When the block ends, the agent and every process it started
    are killed. Agents of one job share `job_key` (hex; default: a new one), which signs their rendezvous."""
    from ...engines import inherited_environment
    from ...processes import arm_parent_death_signal

    marker = marker or uuid.uuid4().hex
    # torchrun's per-run folder (its workers' error files) goes here, removed at the end, not /tmp/torchelastic_*.
    log_dir = None if any(a.startswith("--log-dir") or a.startswith("--log_dir") for a in arguments) else \
        tempfile.mkdtemp(prefix="torchrun-logs-")
    if log_dir:
        arguments = ["--log-dir", log_dir, *arguments]
    env = inherited_environment()
    package_parent = str(Path(__file__).resolve().parents[3])  # ddp_helpers imports as it does in the kernel
    env.update({MARKER_ENV: marker,  # found by _stop's sweep, in every process started
                "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **(extra_env or {}),
                KEY_ENV: job_key or new_job_key(),
                "PYTHONPATH": os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)})
    process = subprocess.Popen(python_module_command("ddp_helpers.guarded_torchrun", *arguments), env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True,
                               # A killed kernel ends the job too: torchrun stops its workers on SIGTERM.
                               preexec_fn=lambda: arm_parent_death_signal(signal.SIGTERM))
    process.marker = marker  # for _stop
    try:
        yield process
    finally:
        _stop(process)
        if process.stdout.closed:  # the block read the output to its end
            process.wait()
        else:
            process.communicate()
        if log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


def new_job_key() -> str:
    """The key one job's agents sign their rendezvous state with (`store_guard`)."""
    return secrets.token_hex(32)


def _stop(process: subprocess.Popen) -> None:
    """Kill a torchrun agent and every process of its marker. The workers run in process groups of their
    own and hold the output pipe open: reading the output to its end before they are dead waits for
    them (a rank in `time.sleep(30)`: 30 s)."""
    from ...processes import kill_marked

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    kill_marked(process.marker, MARKER_ENV)


def run_torchrun_commands(commands: list[list[str]], start_gap_s: float = 0.0, timeout_s: float = 60,
                          extra_env: dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Run `torchrun ARGUMENTS` for each entry of `commands` at once, as terminals would, the next one
    `start_gap_s` after the previous: [(exit code, None if it had to be stopped; its output)].
    Everything they started is killed at the end."""
    marker, job_key = uuid.uuid4().hex, new_job_key()
    with contextlib.ExitStack() as stack:
        processes = []
        for number, arguments in enumerate(commands):
            if number:
                time.sleep(start_gap_s)
            processes.append(stack.enter_context(torchrun_in_background(arguments, marker, extra_env, job_key)))
        deadline = time.monotonic() + timeout_s
        return [_result_by(process, deadline) for process in processes]


def run_torchrun_after(first: list[str], second: list[str], when_first_prints: str, timeout_s: float = 60,
                       extra_env: dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Run `torchrun FIRST`, and `torchrun SECOND` once the first has printed a line containing
    `when_first_prints` (or has ended): as someone watching the first terminal would start the second.
    [(exit code, None if it had to be stopped; output)] of each; everything they started is killed at
    the end."""
    deadline, job_key = time.monotonic() + timeout_s, new_job_key()
    # Each its own marker: the second one's end must not kill the first.
    with torchrun_in_background(first, extra_env=extra_env, job_key=job_key) as first_process:
        lines = []
        # The first one's output, line by line, in a thread: a line that never comes must not block the deadline.
        reader = threading.Thread(target=lambda: lines.extend(first_process.stdout), daemon=True)
        reader.start()
        while not any(when_first_prints in line for line in list(lines)) and reader.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with torchrun_in_background(second, extra_env=extra_env, job_key=job_key) as second_process:
            second_result = _result_by(second_process, deadline)
        reader.join(max(0.1, deadline - time.monotonic()))
        if reader.is_alive():
            _stop(first_process)
            reader.join()
        first_process.wait()
        return [(first_process.returncode if first_process.returncode >= 0 else None, "".join(lines)), second_result]


def _result_by(process: subprocess.Popen, deadline: float) -> tuple[int | None, str]:
    try:
        output, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        _stop(process)
        return None, process.communicate()[0]


def run_torchrun_command(arguments: list[str], timeout_s: float = 60) -> tuple[int | None, str]:
    """`run_torchrun_commands` for one command."""
    return run_torchrun_commands([arguments], timeout_s=timeout_s)[0]


def worker_pids(agent: subprocess.Popen, ranks: int, timeout_s: float = 60) -> dict[int, int]:
    """{rank: pid} of the workers torchrun's agent started, once all `ranks` have started. As you would
    at work on Linux: the agent's child processes, each one's rank read from its environment
    (`/proc/PID/environ`, the RANK torchrun set)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for pid in _children(agent.pid):
            rank = _environment(pid).get("RANK")
            if rank is not None:
                found[int(rank)] = pid
        if len(found) >= ranks:
            return dict(sorted(found.items()))
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"torchrun's workers did not all start ({len(found)} of {ranks} found): "
                               f"{agent.communicate()[0] if agent.poll() is not None else 'still waiting'}")
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return children


def _environment(pid: int) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
