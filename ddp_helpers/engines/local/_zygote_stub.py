"""The worker command of a warm launch: `python -S -u _zygote_stub.py SOCKET -P -m ddp_helpers._bootstrap SCRIPT ...`.

torchrun starts this instead of a Python that would import torch. It imports nothing heavy (run with
-S, standard library only): it hands its environment, working directory, arguments and file
descriptors 0/1/2 to the zygote, which forks the real worker from a process that has torch imported.
Then it stands in for the worker towards torchrun: it forwards every signal torchrun sends (to the
worker's process group, as torchrun does to its own workers), and exits with the worker's status (or
dies of the same signal). When the stub dies (SIGKILL), the zygote kills the worker.

When the zygote cannot take the request (gone, refusing, or not answering within ANSWER_TIMEOUT_S:
stopped with SIGSTOP, say), the stub becomes the cold worker:
it execs `python -u -P -m ddp_helpers._bootstrap ...` in place, so the launch still runs, as it would
without warm launches.
"""

import os
import select
import signal
import socket
import sys

# This file runs as a script (python -S .../_zygote_stub.py): its folder is sys.path[0], and the package's
# standard-library-only modules load as top-level modules (`_framing` from here, `run_folder` from the
# package's folder, only when needed).
from _framing import ForkRequest, receive as _read_message, send

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The zygote answers a fork request in milliseconds; one that does not answer in this time is stopped
# (SIGSTOP) or wedged: the stub runs the worker cold instead.
ANSWER_TIMEOUT_S = 5
# After the worker ended, how long the zygote gets to report its status before the stub reads it from the
# run folder instead.
STATUS_GRACE_S = 2


def _umask() -> int:
    """This process's umask, for the rank the zygote forks (it would otherwise have the zygote's)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc field (old kernels): read it by setting it, then put it back
    os.umask(mask)
    return mask


def _arm_parent_death() -> None:
    # Die with the torchrun agent, as a cold worker would (the zygote then kills the real worker).
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    expected = os.environ.get("DDP_HELPERS_AGENT_PID")
    if expected and os.getppid() != int(expected):
        os._exit(1)


def _wait_for_the_end(sock: socket.socket, worker: int) -> dict | None:
    """The zygote's {"status": ...} once the worker ended; {} when the worker ended and the zygote did not say
    (it is stopped or wedged: it cannot reap its child); None when the zygote went away."""
    try:
        pidfd = os.pidfd_open(worker)  # readable once the worker has exited, reaped or not
    except (AttributeError, OSError):
        return _read_message(sock)
    try:
        ready, _, _ = select.select([sock, pidfd], [], [])
        if sock not in ready:
            ready, _, _ = select.select([sock], [], [], STATUS_GRACE_S)
            if not ready:
                return {}
        return _read_message(sock)
    finally:
        os.close(pidfd)


def _exit_code_from_the_run_folder() -> int:
    """How the worker said it ended (the bootstrap writes its exit code last), else 1."""
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
    from run_folder import RunFolder  # ddp_helpers/run_folder.py, standard library only

    rank, folder = int(os.environ.get("RANK", "0")), RunFolder.from_environment()
    code = folder.read_exit_code(rank) if folder is not None else None
    if isinstance(code, int):
        print(f"[ddp_helpers] the warm process did not report how rank {rank} ended (stopped or wedged); "
              f"it said itself: exit code {code}", file=sys.stderr, flush=True)
        return code
    print(f"[ddp_helpers] the warm process did not report how rank {rank} ended (stopped or wedged), "
          "and the rank did not say either", file=sys.stderr, flush=True)
    return 1


def _run_cold(cold_argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-u", *cold_argv])


def main() -> None:
    _arm_parent_death()
    socket_path, cold_argv = sys.argv[1], sys.argv[2:]
    request = ForkRequest("worker", cold_argv, dict(os.environ), os.getcwd(), _umask()).to_message()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ANSWER_TIMEOUT_S)
    try:
        sock.connect(socket_path)
        send(sock, request, fds=(0, 1, 2))
        started = _read_message(sock)
    except (OSError, ValueError):  # includes the timeout
        started = None
    if not started or "pid" not in started:
        sock.close()
        _run_cold(cold_argv)
    sock.settimeout(None)
    worker = started["pid"]

    def forward(signum, frame):
        try:
            os.killpg(worker, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    ended = _wait_for_the_end(sock, worker)
    if ended is None:
        os._exit(1)  # the zygote died under us; its workers died with it
    if "status" not in ended:
        os._exit(_exit_code_from_the_run_folder())
    status = ended["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught, nor need resetting
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
