"""Worker entry point: `torchrun ... -m ddp_helpers._bootstrap script.py [args]`.

Every rank runs the user's script through this tiny wrapper, which
- exits at once if the torchrun agent is already gone, and otherwise dies with it (parent-death signal),
  so a killed kernel leaves no rank, even one that was just starting;
- sends the rank's stdout/stderr into the run folder (through the supervisor's capped pipes);
- dumps every thread's stack on SIGUSR1 into its stack file, and what it waits in into its hang answer
  when asked through its hang request (the launcher asks both on timeout; `_hang_probe`);
- records the exception that ended the rank, with its time, so the launcher can name the first failure;
- logs the script's point-to-point calls (`_point_to_point`: gloo's are not in the flight recorder, and the
  hang report names a blocking send or recv);
- runs the rank hooks its launch names (`rank_hooks`), and knows none of them: the engine's own (the local
  engine's kill-after and loopback store) and its client's (the course's records for its checkers,
  `evidence_hook`);
- ends the script as the interpreter would (non-daemon threads joined, atexit handlers run, every
  open file flushed), then ends the process with os._exit: a DDP process can otherwise abort in the
  interpreter's final teardown ("terminate called without an active exception", SIGABRT) after all
  its work is done. What still differs from plain torchrun: objects are not finalised (`__del__`
  methods of objects still alive at exit do not run), C++ static destructors do not run.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import functools
import gc
import importlib.machinery
import importlib.util
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
import weakref

from . import _hang_probe, _point_to_point, rank_hooks
from .processes import become_child_subreaper, descendants, die_with_parent, start_time
from .run_folder import (AGENT_ENV, AGENT_PID_ENV, ATTEMPT_MARK, IMPORT_DIR_ENV, NODE_ENV, RankErrorRecord, RankIdentity,
                         RunFolder, open_private)

_BUFFERED_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
_open_stack_file = None  # kept alive: faulthandler writes into it from its signal handler


def _redirect_output(folder: RunFolder, rank: int) -> None:
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        pipe = folder.fifo(rank, kind)
        if pipe.exists():
            target = os.open(pipe, os.O_WRONLY)
        else:  # launched without the supervisor's pipes: plain files
            target = os.open(folder.output(rank, kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _exit_status(exit: SystemExit) -> int:
    """The status the OS reports for `sys.exit(code)`: as the interpreter does, codes wrap modulo 256."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int) and not isinstance(exit.code, bool):
        return exit.code & 0xFF if -(2**31) <= exit.code < 2**31 else 0xFF
    print(exit.code, file=sys.stderr)
    return 1


ERROR_KEEP_CHARS = 32 * 1024  # of an exception's message and traceback, kept from each end in the rank's error record


def _capped(text: str, keep: int = ERROR_KEEP_CHARS) -> str:
    """`text`, or its first and last `keep` characters with a line saying how many were dropped between:
    a 30 MiB exception message must not travel to the notebook several times over."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[ddp_helpers] ... {len(text) - 2 * keep:,} characters dropped here ...\n{text[-keep:]}"


def _print_user_traceback(error: BaseException, script: str) -> str:
    """The traceback from the script's first frame on, as plain torchrun would show it: the bootstrap's
    frames, and those of the wrappers it puts around torch functions (a `dist.all_reduce` that raises
    would show `_all_reduce_log`'s), are noise."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    shown = traceback.TracebackException(type(error), error, tb or error.__traceback__)
    _drop_wrapper_frames(shown, seen=set())
    text = "".join(shown.format())
    hook = _scripts_own_excepthook()
    if hook is None:
        sys.stderr.write(text)
        return text
    # The script installed its own hook (a crash reporter): as under plain Python, it runs instead of the
    # default printing; a hook that fails is reported as Python reports it, then the traceback is printed.
    try:
        hook(type(error), error, _without_wrapper_frames(tb or error.__traceback__))
    except BaseException as hook_error:  # noqa: BLE001 - as Python's own "Error in sys.excepthook"
        sys.stderr.write("Error in sys.excepthook:\n" + "".join(traceback.format_exception(hook_error))
                         + "\nOriginal exception was:\n" + text)
    return text


def _scripts_own_excepthook():
    """The sys.excepthook the script installed, or None (Python's own). torch's `init_process_group` wraps
    the hook it finds in one that prefixes each line with "[rankN]: " (`distributed_c10d.py`,
    `_distributed_excepthook`): the launcher labels each rank's lines itself, so the wrapped hook is what counts."""
    hook = sys.excepthook
    if getattr(hook, "__name__", "") == "_distributed_excepthook" and "old_hook" in hook.__code__.co_freevars:
        hook = hook.__closure__[hook.__code__.co_freevars.index("old_hook")].cell_contents
    return None if hook is sys.__excepthook__ else hook


def _without_wrapper_frames(tb):
    """The traceback without the frames of our wrappers around torch functions (relinked in place)."""
    wrappers = _wrapper_files()
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in wrappers:
        tb = tb.tb_next
    link = tb
    while link is not None:
        while link.tb_next is not None and os.path.abspath(link.tb_next.tb_frame.f_code.co_filename) in wrappers:
            link.tb_next = link.tb_next.tb_next
        link = link.tb_next
    return tb


def _wrapper_files() -> set[str]:
    """Our wrappers around torch functions (the launcher's, and those of this rank's hooks): their frames are noise."""
    return rank_hooks.wrapper_files() | {os.path.abspath(__file__), os.path.abspath(_point_to_point.__file__)}


def _drop_wrapper_frames(shown: traceback.TracebackException, seen: set) -> None:
    """Remove our wrappers' frames from a traceback and the exceptions chained to it."""
    if id(shown) in seen:
        return
    seen.add(id(shown))
    wrappers = _wrapper_files()
    kept = [frame for frame in shown.stack if os.path.abspath(frame.filename) not in wrappers]
    if kept:  # a failure inside our own code keeps its frames: there is nothing else to show
        shown.stack = traceback.StackSummary.from_list(kept)
    for chained in (shown.__cause__, shown.__context__, *(getattr(shown, "exceptions", None) or ())):
        if chained is not None:
            _drop_wrapper_frames(chained, seen)


def _warn_if_process_group_left_open(rank: int) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and not sys.stderr.closed:
        print(
            f"[ddp_helpers] rank {rank}: the process group was still initialised at exit; "
            "call dist.destroy_process_group() at the end of the script.",
            file=sys.stderr,
        )


class _WritesWatch:
    """Whether the script opened anything for writing (Python's audit events "open" for writing, and sockets,
    whose makefile("w") buffers with no "open" event), the run folder's bookkeeping aside (`record`'s facts): only
    then can a buffered file of its be left unflushed at the end, and `_finish_like_the_interpreter` walks every
    object to flush it. The launcher's own hook; what the course records of a rank's writes is its own hook's."""

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self, folder: RunFolder):
        self.folder = folder
        self.opened_for_writing = False

    def __call__(self, event: str, args: tuple) -> None:
        if self.opened_for_writing:
            return
        try:
            if event == "open":
                path, mode, flags = args
                writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & self._WRITE_FLAGS)
                if writes and not (isinstance(path, (str, bytes, os.PathLike))
                                   and self.folder.is_bookkeeping(os.path.abspath(os.fsdecode(path)))):
                    self.opened_for_writing = True
            elif event == "socket.__new__":
                self.opened_for_writing = True
        except Exception:  # noqa: BLE001 - a hook that raises would fail the script's own operation
            self.opened_for_writing = True


def _run_as_main(script: str) -> None:
    """Run the script as the `__main__` module, as `python script.py` would, and keep that module (and
    so everything the script created) alive until the process ends. runpy.run_path would free the
    script's globals on return: DDP's destructor then runs mid-process and can wait forever for a gloo
    thread that needs the interpreter lock (seen in warm ranks)."""
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=script, __cached__=None, __package__=None, __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script), __builtins__=builtins,
    )
    sys.modules["__main__"] = module
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, module.__dict__)


def _flush_standard_streams(exit_code: int) -> int:
    """Flush stdout and stderr as the interpreter does at exit: a stream the script closed is skipped,
    and a flush that fails makes a clean exit 120 (CPython's Py_FinalizeEx)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            closed = getattr(stream, "closed", False)  # a script's own stream object may have no such attribute
        except Exception:  # noqa: BLE001 - as CPython's shutdown: an unreadable `closed` counts as open
            closed = False
        if stream is None or closed is True:
            continue
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a script's stream may raise anything; CPython then exits 120
            exit_code = exit_code or 120
    return exit_code


def _finish_like_the_interpreter(may_hold_open_files: bool = True) -> None:
    """What interpreter shutdown does for a script, short of its final teardown. `may_hold_open_files`: whether
    the script may have left a file it wrote unclosed (the search for them walks every object the garbage
    collector tracks: some 300,000 with torch imported, 0.1 s; a script that opened nothing for writing skips it)."""
    threading._shutdown()  # join non-daemon threads, as the interpreter does first
    _skip_torch_library_teardown()
    atexit._run_exitfuncs()
    if not may_hold_open_files:
        return
    # Files a script never closed: their buffers would be flushed when finalised at shutdown.
    # type() rather than isinstance: isinstance reads __class__, which some lazy objects answer with a warning.
    for obj in gc.get_objects():
        if type(obj) in _BUFFERED_FILE_TYPES:
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken stream must not change the rank's exit
                pass


def _skip_torch_library_teardown() -> None:
    """torch's operator libraries (`torch.library.Library`: some 170 in a rank, torch and torch._dynamo imported)
    are finalised at exit (`weakref.finalize`'s atexit), each taking its operators out of torch's dispatcher
    again (`torch/library.py`, `_del_library`): 40-60 ms of a rank's end, undoing state of this process only,
    which ends right after (os._exit). They no longer run at exit; a script's own finalizers and atexit
    functions do."""
    del_library = getattr(sys.modules.get("torch.library"), "_del_library", None)
    if del_library is None:
        return
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info, "func", None) is del_library:
            finalizer.atexit = False


def _join_run_folder(folder: RunFolder, rank: int):
    """Send the rank's output into the run folder, say who this attempt is, and open its stack file (returned:
    faulthandler writes into it from its signal handler, so it must stay open)."""
    _redirect_output(folder, rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Started before in this launch: torchrun restarted the ranks (after a failure, or because an agent
    # joined or left). The rank's output goes on in the same files: mark where this attempt begins.
    earlier = folder.read_identity(rank)
    attempt = (earlier.attempt if earlier else 0) + 1
    folder.write_identity(RankIdentity(
        rank=rank, pid=os.getpid(), agent=int(os.environ.get(AGENT_ENV) or 0),
        group_rank=int(os.environ.get("GROUP_RANK", "0")), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        restart=restart, attempt=attempt, world_size=int(os.environ.get("WORLD_SIZE", "1")),
        node=os.environ.get(NODE_ENV) or socket.gethostname(),
    ))
    if attempt > 1:
        print(f"{ATTEMPT_MARK} attempt {attempt} of rank {rank} begins (restart count {restart}, world "
              f"size {os.environ.get('WORLD_SIZE')})")
    folder.clear_error(rank)  # an earlier attempt's, before a restart
    stack_file = open_private(folder.stack_file(rank), "w")
    if os.environ.get(_hang_probe.OFF_ENV) != "1":
        _hang_probe.serve(folder, rank, stack_file)
    return stack_file


def _record_what_the_script_left_running(folder: RunFolder) -> None:
    """Every process below this rank (its orphans too: a child subreaper), whatever its group, session or
    environment: the sweep's list (`processes.kill_marked`)."""
    for pid in descendants([os.getpid()]):
        folder.record_forked_child(pid, start_time(pid))


def _start_hooks(folder: RunFolder, rank: int) -> tuple[list, _WritesWatch]:
    """The launcher's own watches, then the rank hooks its launch named (the engine's, its client's: the
    course's records), by name (`rank_hooks`)."""
    watch = _WritesWatch(folder)
    sys.addaudithook(watch)
    # Gloo's send and recv are not in the flight recorder: the hang report reads this log of them.
    rank_hooks.PatchOnImport.install({"torch.distributed.distributed_c10d": _point_to_point.observe})
    hooks = rank_hooks.load()
    for hook in hooks:
        hook.start(folder, rank)
    return hooks, watch


def _finish_hooks(hooks: list, folder: RunFolder, rank: int) -> None:
    for hook in hooks:
        finish = getattr(hook, "finish", None)
        if finish is not None:
            try:
                finish(folder, rank)
            except Exception:  # noqa: BLE001 - a hook's records are never a reason for the rank to fail
                traceback.print_exc()


def main() -> None:
    global _open_stack_file
    if len(sys.argv) < 2:
        sys.exit("usage: python -m ddp_helpers._bootstrap SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    agent_pid = os.environ.get(AGENT_PID_ENV)
    die_with_parent(int(agent_pid) if agent_pid else None)
    become_child_subreaper()  # what the script's children leave orphaned stays below this rank (processes.py)
    rank = int(os.environ.get("RANK", "0"))
    folder = RunFolder.from_environment()
    if folder is not None:
        _open_stack_file = _join_run_folder(folder, rank)
        os.register_at_fork(after_in_child=lambda: folder.record_forked_child(os.getpid(), start_time(os.getpid())))
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, file=_open_stack_file or sys.stderr, all_threads=True)
    hooks, watch = _start_hooks(folder, rank) if folder is not None else ([], None)
    # This process started as `python -P -m` (python_command): no working folder on sys.path, so none could shadow
    # this package. A script runs as `python script.py` would, as torchrun starts a worker: its folder first, and
    # never the working folder (a module in a --cwd of data must not shadow one the script imports under plain
    # torchrun). A cell imports from its notebook's folder and its --cwd as its kernel does: whoever can write
    # those folders decides what its imports find (docs/security.md).
    import_dir = os.environ.get(IMPORT_DIR_ENV)
    cell_folders = dict.fromkeys((import_dir, os.getcwd()) if import_dir else ())
    sys.path[:0] = [os.path.dirname(script), *(folder for folder in cell_folders if folder not in sys.path)]

    exit_code = 0
    try:
        _run_as_main(script)
    except SystemExit as exit:
        exit_code = _exit_status(exit)
    except BaseException as error:  # noqa: BLE001 - any failure ends the rank; it is reported, not hidden
        exit_code = 1
        failed_at = time.time()
        text = _print_user_traceback(error, script)
        if folder is not None:
            folder.write_error(RankErrorRecord(rank=rank, time=failed_at, type=type(error).__name__,
                                               message=_capped(str(error)), traceback=_capped(text)))
    try:
        _finish_like_the_interpreter(may_hold_open_files=watch is None or watch.opened_for_writing)
    except BaseException:  # noqa: BLE001 - e.g. an exception while joining threads: shown, exit unchanged
        traceback.print_exc()
    finally:
        if folder is not None:
            _finish_hooks(hooks, folder, rank)
            _record_what_the_script_left_running(folder)
            # How it ended, for engines with no agent to ask (a cluster's job), and for a rank whose agent was stopped.
            folder.write_exit(rank, exit_code)
        if exit_code == 0:
            _warn_if_process_group_left_open(rank)
        os._exit(_flush_standard_streams(exit_code))


if __name__ == "__main__":
    main()
