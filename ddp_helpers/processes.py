"""Making sure no process of a run outlives it.

Three layers, because each covers a case the others miss:
1. Parent-death signal (Linux prctl): each worker dies with the torchrun agent (SIGKILL), and the
   supervisor that runs the agent is told (SIGTERM) when the launching kernel dies, even by SIGKILL.
   Right after arming it, a process checks that its parent is still the expected one: a parent that
   died a moment earlier would never send the signal.
2. Stopping the supervisor politely (SIGTERM; the agent stops the workers), then SIGKILL after a
   bounded grace period.
3. A sweep of /proc for the run's marker variable, which every process of the run inherits (a rank's
   own children too): run by the supervisor as it ends, and by the launcher after it. It kills what it finds
   with every descendant.
4. Child subreapers (Linux prctl): a rank and a cold supervisor adopt what their descendants leave orphaned,
   so that a child in a group and session of its own with a scrubbed environment (no marker) still sits below
   them: a rank records its whole subtree as it ends (the sweep's list), a supervisor kills its own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


ARMED, ARM_PARENT_DEATH_UNSUPPORTED, ARM_PARENT_DEATH_FAILED = "armed", "unsupported", "parent gone"


def arm_parent_death_signal(sig: int, expected_parent_pid: int | None = None) -> str:
    """Ask Linux to send `sig` to this process when its parent dies. Returns ARM_PARENT_DEATH_FAILED if
    the parent is not (or no longer) `expected_parent_pid`: it died before the signal was armed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return ARM_PARENT_DEATH_UNSUPPORTED
    except (OSError, AttributeError):
        return ARM_PARENT_DEATH_UNSUPPORTED
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        return ARM_PARENT_DEATH_FAILED
    return ARMED


def die_with_parent(expected_parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit now if the parent is already gone."""
    if arm_parent_death_signal(signal.SIGKILL, expected_parent_pid) == ARM_PARENT_DEATH_FAILED:
        os._exit(1)


def become_child_subreaper() -> bool:
    """Ask Linux to make this process the parent of any descendant orphaned below it (instead of init), so that
    `descendants` still finds it. Not inherited by forked children. False where Linux refuses or lacks it."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pids) -> list[int]:
    """Every live process below any of `pids` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(") ", 1)[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], list(pids)
    while frontier:
        below = children.get(frontier.pop(), [])
        found += [pid for pid in below if pid not in found]
        frontier += below
    return found


def process_name_for(run_id: str) -> str:
    """The process name (comm, at most 15 characters) a warm process of run `run_id` carries. Forked
    processes inherit it, so it marks what the environment cannot: a warm process's /proc environ is
    the warm zygote's, and so is that of anything it forks."""
    return f"ddp-{run_id[:11]}"


def set_process_name(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def marked_processes(run_id: str, marker_env: str) -> list[int]:
    """PIDs of live processes of a run: their environment holds `marker_env=run_id` (started with exec),
    or their name is `process_name_for(run_id)` (forked from a warm process). Only this user's: anyone can
    name a process so (names are public in /proc), and a stranger's is neither the run's nor ours to kill."""
    needle = f"{marker_env}={run_id}".encode()
    name = process_name_for(run_id).encode()
    me = os.geteuid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != me:
                continue
            with open(f"/proc/{entry}/comm", "rb") as f:
                if f.read().strip() == name:
                    found.append(int(entry))
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return found


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): with the pid, it names one process, never a later one
    that reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def kill_marked(run_id: str, marker_env: str, wait_s: float = 5.0,
                recorded: list[tuple[int, int]] = ()) -> list[int]:
    """SIGKILL every process of the run (marked, or `recorded` as (pid, start time) while it ran) and wait
    until they are gone. Returns the PIDs killed."""
    pids = marked_processes(run_id, marker_env)
    pids += [pid for pid, started in recorded if pid not in pids and pid != os.getpid() and start_time(pid) == started]
    me = os.geteuid()
    pids += [pid for pid in descendants(pids) if pid not in pids and _owner(pid) == me]
    return _kill_and_wait(pids, wait_s)


def kill_descendants(wait_s: float = 5.0) -> list[int]:
    """SIGKILL every process below this one (with `become_child_subreaper`, the orphans too) and wait until
    they are gone. Returns the PIDs killed."""
    return _kill_and_wait(descendants([os.getpid()]), wait_s)


def _kill_and_wait(pids: list[int], wait_s: float) -> list[int]:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or (its pid reused meanwhile) not ours
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not process_is_dead(pid)]
        time.sleep(0.02)
    return pids


def kill_process_groups(leaders) -> None:
    """SIGKILL the process group of each pid (a rank leads its own, as torchrun starts it in a new
    session): this reaches a rank's forked children, which a warm rank's marker sweep cannot find."""
    for pid in leaders:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def process_is_dead(pid: int) -> bool:
    """True once `pid` has exited or been killed (a zombie is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] in ("Z", "X")
    except OSError:
        return True


def run_despite_interrupts(*steps) -> None:
    """Run each step to its end, in order. A KeyboardInterrupt (stop pressed again) cuts none short: the
    step it interrupted runs again (steps must be safe to repeat), and the interrupt is raised at the end."""
    interrupted = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as again:
                interrupted = again
    if interrupted is not None:
        raise interrupted


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group led by `proc`, then SIGKILL it after `grace_s`; wait for `proc` to end.
    A KeyboardInterrupt (stop pressed again) does not cut this short: it is re-raised at the end."""
    interrupted = None
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            except KeyboardInterrupt as again:
                interrupted = again
    if interrupted is not None:
        raise interrupted
