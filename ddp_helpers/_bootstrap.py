"""Worker entry point: `torchrun ... -m ddp_helpers._bootstrap script.py [args]`.

Every rank runs the user's script through this tiny wrapper, which
- sends the rank's stdout/stderr to its own files in the run directory (the launcher streams them),
- dies with torchrun (parent-death signal) so a killed kernel leaves no orphan,
- dumps every thread's stack on SIGUSR1 (the launcher sends it when a run times out),
- records the exception that ended the rank, with its time, so the launcher can name the first failure,
- ends the process with os._exit after flushing: a DDP process can otherwise abort during interpreter
  shutdown ("terminate called without an active exception", SIGABRT) after all its work is done.
  The price: atexit handlers do not run.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import time
import traceback

from .processes import die_with_parent
from .run_files import RUN_DIR_ENV, rank_file, write_json


def _redirect_output(run_dir: str, rank: int) -> None:
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        target = os.open(rank_file(run_dir, rank, kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _exit_code(exit: SystemExit) -> int:
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _print_user_traceback(error: BaseException, script: str) -> str:
    """The traceback from the script's first frame on: the bootstrap's and runpy's frames are noise."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
    sys.stderr.write(text)
    return text


def _warn_if_process_group_left_open(rank: int) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        print(
            f"[ddp_helpers] rank {rank}: the process group was still initialised at exit; "
            "call dist.destroy_process_group() at the end of the script.",
            file=sys.stderr,
        )


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m ddp_helpers._bootstrap SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _redirect_output(run_dir, rank)
        rank_file(run_dir, rank, "pid").write_text(str(os.getpid()))
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.path.insert(0, os.path.dirname(script))

    exit_code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        exit_code = _exit_code(exit)
    except BaseException as error:  # noqa: BLE001 - any failure ends the rank; it is reported, not hidden
        exit_code = 1
        text = _print_user_traceback(error, script)
        if run_dir:
            write_json(
                rank_file(run_dir, rank, "error.json"),
                {"rank": rank, "time": time.time(), "type": type(error).__name__, "message": str(error),
                 "traceback": text},
            )
    finally:
        if exit_code == 0:
            _warn_if_process_group_left_open(rank)
        sys.stdout.flush()
        sys.stderr.flush()
        if run_dir:
            write_json(rank_file(run_dir, rank, "exit.json"), {"rank": rank, "exit_code": exit_code})
        os._exit(exit_code)


if __name__ == "__main__":
    main()
