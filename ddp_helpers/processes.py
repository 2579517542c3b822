"""Making sure no process of a run outlives it.

Three layers, because each covers a case the others miss:
1. Parent-death signal (Linux prctl): torchrun dies with the launching process, each worker with
   torchrun, even when the launcher is SIGKILLed (Jupyter kills a kernel that way).
2. Stopping torchrun politely (SIGTERM to its process group, which it forwards to the workers),
   then SIGKILL after a grace period.
3. A sweep of /proc for the run's marker variable, which every process of the run inherits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies. If the parent is already gone
    (it died before this call), exit now. Does nothing on systems without prctl."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        os._exit(1)


def marked_processes(run_id: str, marker_env: str) -> list[int]:
    """PIDs of live processes whose environment holds `marker_env=run_id`."""
    needle = f"{marker_env}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return found


def kill_marked(run_id: str, marker_env: str, wait_s: float = 5.0) -> list[int]:
    """SIGKILL every process of the run and wait until they are gone. Returns the PIDs killed."""
    pids = marked_processes(run_id, marker_env)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.02)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie is dead, only not yet reaped
    except OSError:
        return False


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group led by `proc` (torchrun forwards it to its workers), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _exec_with_parent_death() -> None:
    """`python -m ddp_helpers.processes PARENT_PID COMMAND...`: arm the parent-death signal, then exec
    COMMAND. The signal survives exec; doing it here rather than in a Popen preexec_fn keeps the
    launcher safe to call from a process with threads (a Jupyter kernel has several)."""
    import sys

    parent_pid, command = int(sys.argv[1]), sys.argv[2:]
    die_with_parent(parent_pid)
    os.execv(command[0], command)


if __name__ == "__main__":
    _exec_with_parent_death()
