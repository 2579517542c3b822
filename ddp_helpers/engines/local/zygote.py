"""Warm launches: a long-lived process with torch already imported (a "zygote") forks the supervisor and
every rank of a launch, so a `%%torchrun` cell does not wait ~1.3 s per process for `import torch`
(and ~1.2 s more for torch._dynamo, which DDP and the first optimizer import).

    python -m ddp_helpers.engines.local.zygote KERNEL_PID SOCKET_DIR

Each forked child is still a fresh process for the script: its own session, the environment,
working directory, arguments and file descriptors 0/1/2 of the process that asked for it (the
launcher for the supervisor, `_zygote_stub` for a worker), every other descriptor closed, signal
dispositions as a fresh interpreter sets them (SIGPIPE ignored, SIGINT raising KeyboardInterrupt), and
fresh random generators (Python's, numpy's, torch's). Not fresh: the string hash seed (a running
interpreter cannot draw a new one), shared by every warm rank of a kernel; `--cold` or
`--env PYTHONHASHSEED=random` gives each rank its own. What differs
from a cold process: its parent (the zygote), its process title, its /proc/<pid>/environ (the
zygote's; the launcher's sweep finds these processes by process group instead), resource limits
(the zygote's).

Rules that keep forking safe (each was a hang or a deadlock in the prototype):
- the zygote never computes (no thread pool starts) and checks it has exactly one thread before
  every fork; it never initialises CUDA (checked);
- libraries that read the environment when imported (OpenMP, OpenBLAS, torch's logging, tqdm) saw the
  zygote's: the zygote notes every variable Python code reads while it imports them, and the launcher
  launches cold when a launch's value of one of those (or of the families native code reads) differs
  (`environment_mismatch`); a forked rank sets torch's thread count to the one torch chose at import here,
  re-reads TMPDIR (tempfile) and TZ (time.tzset), and takes its client's umask.

Security: the socket lives in a private folder (0700), is itself 0600, and the zygote also checks the
peer's user id (SO_PEERCRED): nothing else can ask it to run code. It dies with the kernel (parent-death
signal), removing its folder; its children notice (the supervisor stops its run; ranks die).

Protocol (one Unix stream connection per child): the client sends a length-prefixed JSON request
a `_framing.ForkRequest` (role "supervisor" or "worker", argv, env, cwd, umask) with its fds 0/1/2 attached; the zygote answers
{"pid": N} once forked, then {"status": wait_status} when the child ends. When the client goes away
first, the zygote kills the child's process group.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time

from . import _framing
from ...processes import process_name_for, set_process_name
from ...python_command import module_arguments
from .. import BOOTSTRAP
from ...run_folder import AGENT_PID_ENV, RUN_ID_ENV
from .warm_environment import installed_fingerprint

# How long a client may take to send its (small) request: the zygote serves one at a time, and the
# launcher and the stubs give up on it after their own answer timeouts (10 s and 5 s).
CLIENT_STALL_S = 2
# How long a supervisor gets to stop its run and sweep when the kernel dies (inside launcher.STOP_BOUND_S).
SUPERVISOR_STOP_S = 10

class _EnvironmentReads(os._Environ):
    """os.environ, noting every variable Python code reads (`os.environ[...]`, `.get`, `os.getenv`, `in`)."""

    names: set[str] = set()

    def __getitem__(self, key):
        _EnvironmentReads.names.add(key)
        return super().__getitem__(key)


def _preimport_noting_environment_reads() -> list[str]:
    """`_preimport()`, returning the names of the variables read while the modules loaded."""
    os.environ.__class__ = _EnvironmentReads
    try:
        _preimport()
    finally:
        os.environ.__class__ = os._Environ
    return sorted(_EnvironmentReads.names)


def write_message(sock: socket.socket, message: dict) -> None:
    _framing.send(sock, message)


def _preimport() -> None:
    import numpy  # noqa: F401 - before torch, as a script importing both would
    import torch
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401

    from ... import _bootstrap, recording  # noqa: F401
    from . import supervisor  # noqa: F401

    # The first optimizer pulls in the rest of torch._dynamo's lazy imports; it computes nothing.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the zygote: forked ranks could not use it")


_torch_threads_at_import = 1  # torch.get_num_threads() once the zygote has imported torch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _stop_blas_threads() -> None:
    """Stop the thread pool OpenBLAS starts as numpy loads it when OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is
    2 or more (common on clusters): the zygote must have one thread to fork. OpenBLAS does the same itself
    before a fork (its pthread_atfork handler, `blas_thread_shutdown_`) and starts the pool again on its next
    use, so a forked rank gets its full pool, as a fresh process would."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower() and line.split()[-1].startswith("/")}
    for library in sorted(libraries):
        try:
            shutdown = ctypes.CDLL(library).blas_thread_shutdown_
        except (OSError, AttributeError):
            continue
        shutdown()


def _peer_uid(conn: socket.socket) -> int:
    credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[1]


def _read_request(conn: socket.socket) -> tuple[_framing.ForkRequest, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    try:
        if not data:
            raise ValueError("empty request")
        message = _framing.receive(conn, already=data)
        if message is None:
            raise ValueError("truncated request")
        return _framing.ForkRequest.from_message(message), fds
    except BaseException:
        for fd in fds:  # descriptors of a request that is not served
            os.close(fd)
        raise


def _become_child(request: _framing.ForkRequest, fds: list[int], go: int) -> None:
    """In the forked child: turn into a fresh process for the request, run it, never return. It starts only
    once the zygote has told the client its pid (`go`): a client that got no answer runs the request cold,
    and this child must then not run it too."""
    code = 1
    try:
        if os.read(go, 1) != b"1":  # the zygote could not answer the client (or died): the client runs it
            os._exit(1)
        os.close(go)
        os.setsid()
        _signals_as_a_fresh_interpreter()
        signal.set_wakeup_fd(-1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(request.env)
        # What a fresh process reads from its environment and its parent at start-up.
        tempfile.tempdir = None  # tempfile caches TMPDIR at first use
        time.tzset()
        os.umask(request.umask)
        # The run's marker where the sweep can see it: /proc environ still shows the zygote's.
        set_process_name(process_name_for(os.environ.get(RUN_ID_ENV, "")))
        os.chdir(request.cwd)  # sys.path stays as `python -P -m ...` started here has it: no working folder
        _fresh_randomness()
        import torch

        # What torch chose at import here, from the same OMP_NUM_THREADS (a launch with another value runs cold):
        # a fresh process's choice, which is not always that value (measured: OMP_NUM_THREADS=3 on 2 cores gave 2).
        torch.set_num_threads(_torch_threads_at_import)
        if request.role == "supervisor":
            from . import supervisor

            code = supervisor.main(request.argv)
        else:
            from ... import _bootstrap

            sys.argv = ["-m", *module_arguments(request.argv, BOOTSTRAP)]  # argv: python_module(BOOTSTRAP), SCRIPT, ARGS
            # The rank dies with its parent, which is this zygote here (the stub stands in for it
            # towards torchrun; the zygote kills the rank if the stub dies).
            os.environ[AGENT_PID_ENV] = str(os.getppid())
            _bootstrap.main()  # ends the process itself
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:  # noqa: BLE001 - report, then end this child only
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _signals_as_a_fresh_interpreter() -> None:
    """The signal dispositions `python script.py` starts with (its parent leaving them at their defaults, as
    torchrun does): the interpreter ignores SIGPIPE and SIGXFSZ (a write to a closed pipe raises
    BrokenPipeError instead of killing the process) and turns SIGINT into KeyboardInterrupt; everything
    else is at its default. The zygote itself ignores SIGINT and SIGPIPE and handles SIGTERM and SIGCHLD."""
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh_randomness() -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


class ZygoteServer:
    """The zygote itself: serves fork requests on its socket, one at a time, and watches its children."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, "zygote.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # pid -> the connection of whoever asked for it
        self.supervisors: set[int] = set()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "signal")
        self._stop_requested = False
        self._pid = os.getpid()

    def stop_on_sigterm(self) -> None:
        """SIGTERM ends `serve` by a flag, not by raising SystemExit from the handler: Python runs a handler at
        whatever bytecode it is at, a finalizer's too, where an exception is printed and dropped ("Exception
        ignored in ..."), and the zygote then went on serving (seen twice in a full suite: two SIGTERMs, no exit).
        A forked child that has not yet reset its signals exits as before."""
        def request_stop(signum, frame):
            if os.getpid() != self._pid:
                sys.exit(0)
            self._stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)

    def serve(self) -> None:
        """Until SIGTERM (`stop_on_sigterm`): the handler only sets a flag, and its wakeup byte ends the select."""
        while not self._stop_requested:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    os.read(self.wakeup_r, 4096)
                    self._reap()
                else:
                    self._client_spoke(key.fileobj, key.data)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            if _peer_uid(conn) != os.getuid():
                raise PermissionError("another user")
            conn.settimeout(CLIENT_STALL_S)  # a client that stalls mid-request must not stall the zygote
            request, fds = _read_request(conn)
            conn.settimeout(None)
        except (OSError, ValueError):
            conn.close()
            return
        go = None  # the child's start signal, written once the client has its pid
        try:
            if len(fds) != 3:
                raise ValueError("expected 3 file descriptors")
            if _threads() != 1:
                _stop_blas_threads()
            if _threads() != 1:  # a fork now could inherit a lock held by another thread
                write_message(conn, {"refused": f"the warm process has {_threads()} threads and cannot fork safely",
                                     "replace": True})
                conn.close()
                return
            go_read, go = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(go)
                _become_child(request, fds, go_read)
            os.close(go_read)
            self.children[pid] = conn
            if request.role == "supervisor":
                self.supervisors.add(pid)
            write_message(conn, {"pid": pid})
            os.write(go, b"1")
            self.selector.register(conn, selectors.EVENT_READ, pid)
        except (OSError, ValueError):
            conn.close()
        finally:
            if go is not None:
                os.close(go)
            for fd in fds:
                os.close(fd)
        self._reap()  # a child that ended at once

    def _client_spoke(self, conn: socket.socket, pid: int) -> None:
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if not gone:
            return
        self.selector.unregister(conn)
        if pid in self.supervisors:
            # The kernel that asked for this run is gone: the supervisor stops its run and sweeps what the
            # ranks left behind (SIGKILL would leave their daemons), within the launcher's bound.
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            return
        # A rank's stub died (torchrun killed it): so must the rank, with its process group.
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.supervisors.discard(pid)
            if conn is None:
                continue
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                write_message(conn, {"status": status})
            except OSError:
                pass
            conn.close()

    def shutdown(self) -> None:
        """The kernel is gone: let each run's supervisor stop its run and sweep (what its ranks left
        behind, daemons included), within the launcher's bound; then kill whatever is left."""
        # A second SIGTERM (a kernel shut down with now=True sends two) must not cut this short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        running = {pid for pid in self.supervisors if pid in self.children}
        for pid in running:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + SUPERVISOR_STOP_S
        while running and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                running.discard(pid)
                self.children.pop(pid, None)
            else:
                time.sleep(0.05)
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    kernel_pid, folder = int(argv[0]), argv[1]
    from ...processes import ARM_PARENT_DEATH_FAILED, arm_parent_death_signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's stop button is for the kernel, not us
    if arm_parent_death_signal(signal.SIGTERM, kernel_pid) == ARM_PARENT_DEATH_FAILED:
        shutil.rmtree(folder, ignore_errors=True)
        return 1
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the loop through the wakeup fd
    zygote = None
    try:
        global _torch_threads_at_import
        read_at_import = _preimport_noting_environment_reads()
        _torch_threads_at_import = sys.modules["torch"].get_num_threads()
        _stop_blas_threads()
        zygote = ZygoteServer(folder)
        zygote.stop_on_sigterm()
        with open(os.path.join(folder, "ready"), "w") as ready:
            ready.write(json.dumps({**installed_fingerprint(), "read_at_import": read_at_import}))
        zygote.serve()
    finally:
        if zygote is not None:
            zygote.shutdown()
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
