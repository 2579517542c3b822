"""Launching a script on every rank: start, follow, stop, read back. Whatever happens, nothing of the run
survives it, and nothing of the user's is touched.

    from ddp_helpers import make_launch_config, launch
    run = launch(make_launch_config("train.py", nproc=2))
    run.ranks[1].stdout, run.ranks[1].facts["loss"], run.ok

`launch` is one follow loop for every engine (`engines`): it claims the run folder (`run_folder.RunFolder`:
created and marked by ddp_helpers, or refused; locked, so a concurrent launch cannot mix its files in),
starts the engine, streams each rank's output here live, prefixed by rank, enforces the deadline, stops
the engine in `finally`, and reads the run folder back into a `RunResult`. The engine is the config's
job's (`engines`): torchrun agents on this machine, cold or warm, by default (`engines.local`).

Failure handling, for every engine:
- The run exceeds `timeout_s`: the engine gathers what it can (the local engine: what each rank waits in,
  and its stack), then the run is stopped.
- KeyboardInterrupt (the notebook's stop button, once or several times): the engine asks the live ranks what
  they wait in (as at a timeout: a second press cuts it short), the run is stopped, the hang report is printed,
  then the interrupt goes on.
- Any error here: the run is stopped, then the error goes on.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import replace

from .engines import Engine, LaunchConfig
from .errors import LaunchError
from .output import RankOutputStreamer, show_failures_once
from .processes import run_despite_interrupts
from .readback import collect_result
from .waiting_line import WaitingLine
from .result import RunResult
from .private_folders import claim_run_folder
from .run_folder import RunFolder


def launch(config: LaunchConfig, folder: RunFolder | None = None) -> RunResult:
    """Run `config.script` on `config.world_size` ranks and wait for it (at most `config.timeout_s`).

    Args:
        config (LaunchConfig): from `make_launch_config`.
        folder (RunFolder | None): `config.run_dir`, already claimed by the caller (the magic claims it
            before writing the cell's script); claimed and released here when omitted.

    Returns:
        RunResult: per rank its exit code, output and recorded facts. A failed run is returned, not
        raised: call `run.raise_for_failure()` or check `run.ok`.

    Raises:
        LaunchError: the run folder exists but was not made by ddp_helpers, or another launch is using it;
            the job's engine refused it (a cluster's scheduler), or it can never start as asked.

    Warning:
        Do not initialise CUDA in the calling process before launching on GPUs (nothing here does).
    """
    if config.job is None:
        raise LaunchError("this LaunchConfig names no job to run it: make it with make_launch_config.")
    own_folder = folder is None
    if own_folder:
        folder = claim_run_folder(config.run_dir)
    try:
        return follow(config.job.engine(config, folder), config, folder)
    finally:
        if own_folder:
            folder.release()


def follow(engine: Engine, config: LaunchConfig, folder: RunFolder) -> RunResult:
    """Start `engine`, stream the ranks' output until the run ends or times out, stop it, read it back."""
    run_id = uuid.uuid4().hex
    folder.start_launch(run_id)
    color = sys.stdout.isatty() or "ipykernel" in sys.modules
    streamer = RankOutputStreamer(folder, config.world_size, enabled=config.stream, color=color)
    start = time.monotonic()
    timed_out, stopped = False, None
    waiting = WaitingLine(config.timeout_s, enabled=config.stream, ask=engine.ask_what_is_unfinished,
                          answers=lambda: folder.take_peek_answers(config.world_size))
    try:
        engine.start(run_id)
        # The timeout counts from the run's start: not the wait for a warm process still starting.
        deadline = time.monotonic() + config.timeout_s
        waiting.started = time.monotonic()
        while True:
            streamer.poll()  # before asking the engine: its notes ("killing rank 1 ...") follow the lines they cite
            waiting.tick(streamer.last_output_at)
            if not engine.running():
                break
            if time.monotonic() > deadline:
                timed_out = True
                waiting.clear()
                engine.on_timeout(streamer)
                break
            engine.wait_for_end(engine.poll_interval_s)
    except KeyboardInterrupt as interrupt:  # the stop button, Ctrl-C: where each rank was, as a timeout tells it
        stopped = interrupt
        waiting.clear()
        _where_each_rank_was(engine, streamer)
    finally:  # normal end, timeout, KeyboardInterrupt (stop button) or any error: nothing of the run survives
        waiting.clear()
        _stop(engine, streamer)
        folder.take_peek_answers(config.world_size)  # the waiting line's last answers: nothing of it stays
    if stopped is not None:
        _show_where_each_rank_was(config, folder, engine, streamer, time.monotonic() - start)
        raise stopped
    result = collect_result(config, folder, engine.ending(), wall_time_s=time.monotonic() - start,
                            timed_out=timed_out)
    show_failures_once(streamer, result)
    return result


def _show_where_each_rank_was(config: LaunchConfig, folder: RunFolder, engine: Engine, streamer: RankOutputStreamer,
                              wall_time_s: float) -> None:
    """After a stop press: the hang report of what the ranks answered, as a timed-out run shows it."""
    try:
        hang = collect_result(config, folder, engine.ending(), wall_time_s=wall_time_s, timed_out=True).hang
    except Exception:  # noqa: BLE001 - stopped before anything could be read back: nothing to show
        return
    if hang is not None and streamer.enabled:
        print(replace(hang, ended="was stopped").text(), file=sys.stderr, flush=True)


def _where_each_rank_was(engine: Engine, streamer: RankOutputStreamer) -> None:
    """Ask the live ranks what they wait in, as at a timeout (`Engine.on_timeout`); pressing stop again, or an
    engine that had not started its ranks, cuts it short: the run is stopped either way."""
    try:
        engine.on_timeout(streamer, why="stopped")
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001 - a report that cannot be had must not stand in the way of the stop
        pass


def _stop(engine: Engine, streamer: RankOutputStreamer) -> None:
    """Stop the engine, then show the last of the output; pressing stop again meanwhile cuts neither short."""
    run_despite_interrupts(engine.stop, streamer.finish)
