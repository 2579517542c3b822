"""Streaming each rank's output files into the notebook, line by line, with a rank prefix."""

from ddp_helpers.output import RankOutputStreamer
from ddp_helpers.run_files import rank_file


def test_complete_lines_stream_with_prefixes_and_partial_lines_wait(tmp_path, capsys):
    streamer = RankOutputStreamer(tmp_path, nproc=2, color=False)
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
    streamer = RankOutputStreamer(tmp_path, nproc=1, color=False)
    rank_file(tmp_path, 0, "stderr").write_bytes(b"\r 10%\r 50%\r100%\nlast words")
    streamer.finish()
    assert capsys.readouterr().err == "[rank 0]  10%\n[rank 0]  50%\n[rank 0] 100%\n[rank 0] last words\n"


def test_disabled_streaming_prints_nothing(tmp_path, capsys):
    rank_file(tmp_path, 0, "stdout").write_bytes(b"quiet\n")
    RankOutputStreamer(tmp_path, nproc=1, enabled=False).finish()
    assert capsys.readouterr().out == ""
