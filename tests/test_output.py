"""Streaming each rank's output files into the notebook, line by line, with a rank prefix."""

import re

from ddp_helpers.output import RankOutputStreamer
from ddp_helpers.run_folder import RunFolder


def rank_file(path, rank, kind):
    folder = RunFolder(path)
    return folder.stack_file(rank) if kind == "stack" else folder.output(rank, kind)


def test_complete_lines_stream_with_prefixes_and_partial_lines_wait(tmp_path, capsys):
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=2, color=False)
    rank_file(tmp_path, 0, "stdout").write_bytes(b"first\n\nsecond without newline")
    rank_file(tmp_path, 1, "stderr").write_bytes(b"warning\n")
    streamer.poll()
    shown = capsys.readouterr()
    assert shown.out == "[rank 0] first\n[rank 0] \n"  # blank lines kept, the unfinished line waits
    assert shown.err == "[rank 1] warning\n"
    with open(rank_file(tmp_path, 0, "stdout"), "ab") as f:
        f.write(b" - now done\n")
    streamer.poll()
    assert capsys.readouterr().out == "[rank 0] second without newline - now done\n"


def test_progress_bar_redraws_become_lines_and_finish_flushes_the_rest(tmp_path, capsys):
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=1, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b"\r 10%\r 50%\r100%\nlast words")
    streamer.finish()
    assert capsys.readouterr().err == "[rank 0]  10%\n[rank 0]  50%\n[rank 0] 100%\n[rank 0] last words\n"


def test_disabled_streaming_prints_nothing(tmp_path, capsys):
    rank_file(tmp_path, 0, "stdout").write_bytes(b"quiet\n")
    RankOutputStreamer(RunFolder(tmp_path), world_size=1, enabled=False).finish()
    assert capsys.readouterr().out == ""


def test_capped_output_keeps_the_first_and_last_bytes_and_says_how_much_was_dropped(tmp_path):
    from ddp_helpers.engines.local.supervisor import CappedOutput

    capped = CappedOutput(tmp_path / "out", keep=20)
    for i in range(100):
        capped.write(f"line {i:02d}\n".encode())
    capped.close()
    text = (tmp_path / "out").read_text()
    assert text.startswith("line 00\nline 01\nline")
    assert text.endswith("line 98\nline 99\n")
    dropped = 800 - len("line 00\nline 01\nline") - len("line 98\nline 99\n")
    assert f"{dropped:,} bytes of output dropped here" in text


def test_text_in_a_growing_file_is_found_also_across_two_reads(tmp_path):
    from ddp_helpers.text_in_file import TextInFile

    path = tmp_path / "rank0.stdout"
    watch = TextInFile(path, "step 5 done")
    assert not watch.seen()  # no file yet
    path.write_text("step 4 done\nstep 5 d")
    assert not watch.seen()
    with open(path, "a") as f:
        f.write("one\n")
    assert watch.seen()


def test_a_stack_dump_shows_the_learners_frames_and_the_collective_and_folds_the_rest(tmp_path, capsys):
    import torch

    torch_folder = str(__import__("pathlib").Path(torch.__file__).parent)
    learner = str(tmp_path / "runs" / "lesson" / "scripts" / "exercise" / "exercise.py")
    dump = (
        "Thread 0x00007f00000001 (most recent call first):\n"
        f'  File "{__import__("threading").__file__}", line 320 in wait\n'
        f'  File "{torch_folder}/utils/data/_utils/pin_memory.py", line 50 in _pin_memory_loop\n'
        "\n"
        "Current thread 0x00007f00000002 (most recent call first):\n"
        f'  File "{torch_folder}/distributed/distributed_c10d.py", line 2871 in recv\n'
        f'  File "{torch_folder}/distributed/c10d_logger.py", line 81 in wrapper\n'
        f'  File "{learner}", line 33 in <module>\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
        f'  File "{__import__("ddp_helpers").__path__[0]}/_bootstrap.py", line 300 in main\n'
    )
    rank_file(tmp_path, 1, "stack").write_text(dump)
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=2, color=False)
    streamer.finish()
    streamer.show_stacks()
    streamer.show_stacks()  # once only
    assert capsys.readouterr().err.splitlines() == [
        "[rank 1] where rank 1 was when the run timed out (your code, innermost call first; 5 frames of torch, "
        "Python and ddp_helpers folded, all kept in run.ranks[1].stderr):",
        "[rank 1]   waiting in torch.distributed.recv",
        '[rank 1]   File "exercise.py", line 33 in <module>',
    ]


def test_a_traceback_waits_for_the_root_cause_and_an_attempt_that_restarted_shows_one_line(tmp_path, capsys):
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=2, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b'Traceback (most recent call last):\n  File "a.py", line 3, in <module>\n'
                                                 b"RuntimeError: Connection closed by peer\n")
    rank_file(tmp_path, 1, "stderr").write_bytes(b'Traceback (most recent call last):\n  File "a.py", line 5, in <module>\n'
                                                 b"ValueError: bad batch\n")
    streamer.poll()
    assert capsys.readouterr().err == ""  # held until the run's root cause is known
    from ddp_helpers.run_folder import ATTEMPT_MARK

    rank_file(tmp_path, 0, "stdout").write_bytes(f"{ATTEMPT_MARK} attempt 2 of rank 0 begins\n".encode())  # a restart
    streamer.poll()
    assert capsys.readouterr().err == ("[rank 0] RuntimeError: Connection closed by peer  (how this attempt ended; "
                                       "the traceback is in run.ranks[0].stderr)\n")
    streamer.finish()
    streamer.show_failures(1, {1: "ValueError: bad batch"})
    assert capsys.readouterr().err.splitlines() == [
        "[rank 1] Traceback (most recent call last):", '[rank 1]   File "a.py", line 5, in <module>',
        "[rank 1] ValueError: bad batch"]


def test_a_rank_stopped_before_its_error_was_recorded_shows_one_line_after_the_root_cause(tmp_path, capsys):
    # Rank 0 printed its traceback (its barrier lost rank 1), then torchrun's SIGTERM came before it recorded it.
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=2, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b'Traceback (most recent call last):\n  File "a.py", line 6, in <module>\n'
                                                 b"RuntimeError: Connection closed by peer\n")
    rank_file(tmp_path, 1, "stderr").write_bytes(b'Traceback (most recent call last):\n  File "a.py", line 5, in <module>\n'
                                                 b"KeyError: 'missing column'\n")
    streamer.poll()
    streamer.finish()
    streamer.show_failures(1, {})  # neither rank's error recorded in time to name it here
    shown = capsys.readouterr().err
    assert shown.count("Traceback (most recent call last)") == 1 and shown.index("KeyError") < shown.index("rank 0]"), shown
    assert "[rank 0] RuntimeError: Connection closed by peer  (after rank 1's failure; its traceback is in " \
           "run.ranks[0].stderr)" in shown, shown


def test_a_traceback_a_rank_printed_and_went_on_from_is_shown_as_printed(tmp_path, capsys):
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=1, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b"Traceback (most recent call last):\nKeyError: 'x'\n")
    streamer.poll()
    rank_file(tmp_path, 0, "stdout").write_bytes(b"handled it, going on\n")
    streamer.poll()
    shown = capsys.readouterr()
    assert shown.err == "[rank 0] Traceback (most recent call last):\n[rank 0] KeyError: 'x'\n"
    assert shown.out == "[rank 0] handled it, going on\n"


def test_a_held_traceback_shows_as_it_is_once_the_run_goes_on_for_seconds(tmp_path, capsys, monkeypatch):
    import ddp_helpers.output as output

    monkeypatch.setattr(output, "HOLD_TRACEBACK_S", 0.0)
    streamer = RankOutputStreamer(RunFolder(tmp_path), world_size=1, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b"Traceback (most recent call last):\nKeyError: 'x'\n")
    streamer.poll()
    streamer.poll()
    assert capsys.readouterr().err == "[rank 0] Traceback (most recent call last):\n[rank 0] KeyError: 'x'\n"
    streamer.show_failures(0, {0: "KeyError: 'x'"})
    assert capsys.readouterr().err == "", "shown once"


def test_text_counts_as_seen_once_its_line_is_complete(tmp_path):
    from ddp_helpers.text_in_file import TextInFile

    out = tmp_path / "rank1.stdout"
    out.write_bytes(b"step 1 done\nready")
    watcher = TextInFile(out, "ready now")
    assert not watcher.seen()
    with open(out, "ab") as f:
        f.write(b" now")  # an unbuffered print: the text first...
    assert not watcher.seen()
    with open(out, "ab") as f:
        f.write(b"\n")  # ...then its newline
    assert watcher.seen()


def test_a_silent_run_gets_one_waiting_line_that_goes_when_a_rank_prints(write_script, capfd, monkeypatch):
    """No rank prints for a while: one line, redrawn in place, says so and what to press; it is taken away when a
    rank prints again, and never shows for a run that keeps printing."""
    from ddp_helpers import waiting_line
    from support import failure_report, run_on_cpu

    monkeypatch.setattr(waiting_line, "SILENT_FOR_S", 1.0)
    script = write_script("quiet", "import time\ntime.sleep(3.5)\nprint('back', flush=True)\n")
    run = run_on_cpu(script, timeout_s=60)
    assert run.ok, failure_report(run)
    captured = capfd.readouterr()
    said = captured.err.count("no rank has printed for")
    # Redrawn about once a second (the run's start, slower under load, is silence too), not once a poll.
    assert 1 <= said <= run.wall_time_s + 1, captured.err
    assert "Press stop to see where each rank is" in captured.err
    assert captured.err.rstrip().endswith("\x1b[2K") or "\r\x1b[2K" in captured.err.split("no rank has printed")[-1]
    # A run printing every 0.3 s, with room for a start slowed by load before its first line.
    monkeypatch.setattr(waiting_line, "SILENT_FOR_S", 5.0)
    chatty = write_script("chatty", "import time\nfor _ in range(8):\n    print('.', flush=True)\n    time.sleep(0.3)\n")
    assert run_on_cpu(chatty, timeout_s=60).ok
    assert "no rank has printed" not in capfd.readouterr().err


def test_the_waiting_line_names_the_collective_each_rank_has_not_finished_and_leaves_nothing_behind(
        write_script, capfd, monkeypatch):
    """While a run is silent the line asks the ranks, quietly, what they have not finished: rank 0 in an all_reduce
    that rank 1 joins late. The run then ends well, and nothing of the asking is left: no answer file, no stack."""
    from ddp_helpers import waiting_line
    from support import failure_report, run_on_cpu

    monkeypatch.setattr(waiting_line, "SILENT_FOR_S", 1.0)
    monkeypatch.setattr(waiting_line, "ASK_EVERY_S", 0.5)
    script = write_script("late", """
        import time
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        print("ready", flush=True)
        if rank == 1:
            time.sleep(6)  # late for the all_reduce rank 0 waits in
        dist.all_reduce(torch.ones(3))
        print("done", flush=True)
        dist.destroy_process_group()
    """)
    run = run_on_cpu(script, nproc=2, timeout_s=60)
    assert run.ok, failure_report(run)
    err = capfd.readouterr().err
    assert re.search(r"Not finished: rank 0 all_reduce #\d+; rank 1 no collective\.", err), err
    left = sorted(p.name for p in run.run_dir.iterdir() if p.name.endswith((".peek.json", ".stack", ".hang.json")))
    assert left == [], left
    assert not (run.run_dir / "flight_recorder").exists()
