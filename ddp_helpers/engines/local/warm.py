"""The kernel's side of warm launches: starting the zygote (`zygote.py`), deciding per launch whether
it can be used, and a Popen-like handle for a supervisor it forked.

The zygote starts at `%load_ext ddp_helpers` (in the background) or at the first launch; a launch that
finds it still starting waits for it (up to WARM_START_WAIT_S from its start) and runs warm: a cold launch
beside the zygote's own imports would pay for torch's imports twice, and on a few cores take longer than
waiting. It serves every launch of this process. A launch runs cold, with a one-line note, when the warm
path could not promise the same result: the launch's environment differs in a variable read at import time, torch
changed on disk since the zygote imported it, or the zygote died. `cold=True` (magic: `--cold`)
always launches cold, and so does every launch of a process started with DDP_HELPERS_COLD=1.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ...python_command import python_module_command
from . import _framing
from .warm_environment import environment_mismatch, packages_fingerprint, torch_fingerprint

COLD_NOTE = "[ddp_helpers] this launch starts its ranks as new Python processes (a few seconds slower): "

COLD_ENV = "DDP_HELPERS_COLD"
# How long a launch waits for a zygote that is still starting before it runs cold instead (it is ready
# in a few seconds; much longer means a machine so loaded that the wait would not pay).
WARM_START_WAIT_S = 30
ANSWER_TIMEOUT_S = 10  # the zygote answers in milliseconds; silence this long means it is stopped or wedged
STATUS_GRACE_S = 2  # after the supervisor exited, how long the zygote gets to report it


class WarmRefused(OSError):
    """The warm process refused to start a run; `replace`: it could not serve later runs either."""

    def __init__(self, why: str, replace: bool):
        super().__init__(f"the warm process did not start the run ({why})")
        self.replace = replace


class WarmProcess:
    """A child forked by the zygote, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, conn: socket.socket, pid: int):
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self.unreported = False  # it ended, and the zygote (stopped or wedged) never said how
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # readable once it has exited, reaped or not
        except (AttributeError, OSError):
            self._pidfd = None

    @classmethod
    def start(cls, socket_path: str, request: _framing.ForkRequest, fds: tuple[int, int, int]) -> "WarmProcess":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(ANSWER_TIMEOUT_S)  # it answers in milliseconds: no answer means stopped or wedged
        try:
            conn.connect(socket_path)
            _framing.send(conn, request.to_message(), fds)
            answer = _read_message(conn)
        except BaseException:
            conn.close()
            raise
        if not answer or "pid" not in answer:
            conn.close()
            raise WarmRefused((answer or {}).get("refused", "no answer"), replace=bool((answer or {}).get("replace")))
        return cls(conn, answer["pid"])

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                message = _read_message(self._conn)
            except (BlockingIOError, InterruptedError):
                self._conn.setblocking(True)
                if self._ended_unreported():
                    self.unreported = True
                    self.returncode = 1
                    self._close()
                return None if self.returncode is None else self.returncode
            self._take(message)
        return self.returncode

    def ended_fd(self) -> int | None:
        """Readable once the zygote said how it ended (or went away): for a select() between polls."""
        return None if self.returncode is not None else self._conn.fileno()

    def _ended_unreported(self) -> bool:
        """The supervisor has exited, and the zygote still says nothing after STATUS_GRACE_S."""
        if self._pidfd is None or not select.select([self._pidfd], [], [], 0)[0]:
            return False
        return not select.select([self._conn], [], [], STATUS_GRACE_S)[0]

    def _close(self) -> None:
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                message = _read_message(self._conn)
            except TimeoutError:
                raise subprocess.TimeoutExpired("warm supervisor", timeout) from None
            self._take(message)
        return self.returncode

    def _take(self, message: dict | None) -> None:
        status = (message or {}).get("status")
        # No message: the zygote died, and the child with it.
        self.returncode = os.waitstatus_to_exitcode(status) if status is not None else -signal.SIGKILL
        self._close()


def what_happened_to_the_warm_process(supervisor: "WarmProcess") -> str | None:
    """A note for a run whose warm process failed it midway, or None."""
    if supervisor.unreported:
        return ("the warm process stopped answering during the run (stopped with SIGSTOP, or wedged): the ranks' "
                "exit codes come from what they wrote themselves; the next launch replaces it")
    zygote = _ZYGOTE.process
    if supervisor.returncode == -signal.SIGKILL and zygote is not None and zygote.poll() is not None:
        return (f"the warm process died during the run ({_how_it_ended(zygote.returncode)}), and the run's processes "
                "with it; the next launch starts a new one")
    return None


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _read_message(sock: socket.socket) -> dict | None:
    header = sock.recv(4, socket.MSG_PEEK)
    if not header:
        return None
    sock.setblocking(True)
    message = _framing.receive(sock)
    if message is None:
        raise OSError("connection closed")
    return message


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T) or stopped by a tracer (t)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def current_umask() -> int:
    """This process's umask (the kernel's: a cell may have changed it), for the supervisor the zygote forks."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class ZygoteHandle:
    """The zygote of this process, as the launcher sees it."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.folder: str | None = None
        self.env: dict[str, str] = {}
        self.fingerprint: dict = {}  # what the warm process wrote when ready: fingerprints, variables it read
        self.started_at = 0.0

    def unusable(self) -> bool:
        """It was started and has died since, or is stopped (SIGSTOP, a debugger)."""
        process = self.process  # another thread may replace it meanwhile
        return process is not None and (process.poll() is not None or _stopped(process.pid))

    @property
    def socket_path(self) -> str:
        return os.path.join(self.folder, "zygote.sock")

    def start(self, env: dict[str, str]) -> None:
        """Start the zygote in the background, with `env` (a launch's environment, without its run's markers)."""
        folder = tempfile.mkdtemp(prefix="ddp_helpers-zygote-")  # private: 0700
        self.env = dict(env)
        with open(os.path.join(folder, "zygote.log"), "wb") as log:
            process = _popen_from_a_lasting_thread(
                python_module_command("ddp_helpers.engines.local.zygote", str(os.getpid()), folder),
                env=self.env, cwd=folder, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # the stop button's SIGINT is for the kernel
            )
        self.folder, self.fingerprint, self.started_at = folder, {}, time.monotonic()
        self.process = process
        atexit.register(self.stop)

    def ready(self) -> bool:
        process, folder = self.process, self.folder  # another thread may replace them meanwhile
        if process is None or process.poll() is not None:
            return False
        ready = Path(folder, "ready")
        if not ready.is_file():
            return False
        if not self.fingerprint:
            try:
                self.fingerprint = json.loads(ready.read_text())
            except ValueError:
                return False  # being written
        return True

    def wait_until_ready(self, timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return True
            if self.process is None or self.unusable():
                return False
            time.sleep(0.05)
        return False

    def why_not(self, launch_env: dict[str, str], base_env: dict[str, str]) -> tuple[str, bool] | None:
        """(why this launch cannot be warm, as a note for the user; whether the warm process must be replaced),
        or None when it can. `base_env` is the launch's environment without what this cell alone adds."""
        if self.process is not None and self.process.poll() is not None:
            return "the warm process died; it is started again for the next launch", True
        if self.process is not None and _stopped(self.process.pid):
            return ("the warm process is stopped (SIGSTOP, or a debugger) and cannot answer; it is replaced by a "
                    "new one"), True
        read = set(self.fingerprint.get("read_at_import") or ()) if self.fingerprint else None
        changed = environment_mismatch(self.env, base_env, read)
        if changed:  # the kernel's own environment changed: every later launch would differ too
            return f"{changed}; the warm process is started again with the new environment", True
        mismatch = environment_mismatch(self.env, launch_env, read)
        if mismatch:  # this cell's --env: the warm process's modules may have read another value already
            return f"{mismatch} (this launch's own --env or extra_env)", False
        if self.fingerprint and self.fingerprint.get("torch") != torch_fingerprint():
            return "torch changed on disk since the warm process imported it; it is started again", True
        if self.fingerprint and self.fingerprint.get("packages") != packages_fingerprint():
            return ("packages were installed or removed since the warm process started (site-packages changed: "
                    "only a fresh process reads its .pth files); it is started again"), True
        return None

    def note(self, text: str) -> None:
        """Say, in one line, why this launch runs cold: at every launch it does, not only the first."""
        # A cold launch: fresh interpreters that import torch themselves, not forked from the warm process. Said
        # without the jargon: a learner meets it mid-lesson (deep dive 2b's TORCH_DISTRIBUTED_DEBUG).
        print(f"{COLD_NOTE}{text}", file=sys.stderr, flush=True)

    def replace(self) -> None:
        """Stop this warm process and start a new one with the same environment, for the next launches."""
        with _STARTING:
            env = self.env
            self.stop()
            self.start(env)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.send_signal(signal.SIGCONT)  # a stopped one must wake up to clean up
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.process = None


def _popen_from_a_lasting_thread(*args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen, run in the main thread or in one long-lived thread: Linux sends the warm process its
    parent-death signal when the *thread* that started it ends (prctl(2), PR_SET_PDEATHSIG), so one started
    by a launch in a short-lived thread (a thread pool's) would be killed with that thread."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-helpers-warm")
            _SPAWNER.submit(lambda: None).result()  # its one thread, started now: it lives as long as this process
        return _SPAWNER.submit(subprocess.Popen, *args, **kwargs).result()


_SPAWNER: concurrent.futures.ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()
_ZYGOTE = ZygoteHandle()
_STARTING = threading.Lock()


def warm_zygote(launch_env: dict[str, str], run_env_keys: tuple[str, ...],
                base_env: dict[str, str] | None = None) -> ZygoteHandle | None:
    """The zygote to fork this launch's supervisor from, or None (launch cold; a note says why, when the
    reason is worth knowing). Starts the zygote for later launches when there is none. `base_env`: the
    launch's environment without what this cell alone adds (its --env), which the zygote is started with."""
    if os.environ.get(COLD_ENV) == "1":
        return None
    zygote = _ZYGOTE
    base_env = {k: v for k, v in (launch_env if base_env is None else base_env).items() if k not in run_env_keys}
    with _STARTING:  # launches from several threads start one zygote, not one each
        if zygote.process is None:
            zygote.start(base_env)
    # A cell whose own --env sets a variable of a family read at import (OMP_*, TORCH_*, ...) runs cold anyway:
    # it does not wait. Other variables (FAIL_RANK=1) are known to be safe only once the warm process has
    # said what it read: such a launch waits and usually runs warm. Each warm process gets WARM_START_WAIT_S
    # from its start in all, not per launch.
    if environment_mismatch(base_env, launch_env, read=set()) is None:
        zygote.wait_until_ready(max(0.0, zygote.started_at + WARM_START_WAIT_S - time.monotonic()))
    with _STARTING:
        cold = zygote.why_not(launch_env, base_env)
        if cold is not None:
            reason, replace = cold
            if replace:
                zygote.stop()
                zygote.start(base_env)
            zygote.note(reason)
            return None
    return zygote if zygote.ready() else None


def prepare_warm_launches(env: dict[str, str], run_env_keys: tuple[str, ...], timeout_s: float | None = 60) -> bool:
    """Start the zygote now and wait until it is ready (tests, benchmarks; `%load_ext` without waiting). True
    when ready. One that died or was stopped (SIGSTOP) since it started is replaced, as the next launch would
    replace it.
    `timeout_s=None`: only start it (not under DDP_HELPERS_COLD=1), and return whether it is ready now."""
    if timeout_s is None and os.environ.get(COLD_ENV) == "1":
        return False
    with _STARTING:
        if _ZYGOTE.unusable():
            _ZYGOTE.stop()
        if _ZYGOTE.process is None:
            _ZYGOTE.start({k: v for k, v in env.items() if k not in run_env_keys})
    return _ZYGOTE.ready() if timeout_s is None else _ZYGOTE.wait_until_ready(timeout_s)


