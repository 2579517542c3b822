"""The hang report of a timed-out run: each hang, stopped by its timeout, gets the table and the sentence
that names its cause; a run that finishes has none."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_helpers.hang import RankState, build_report
from support import failure_report, run_on_cpu

# Warm launches: ranks forked from the warm process start in a fraction of a second even on a loaded
# machine, so that the timeout catches each run in its hang, never still importing torch.
pytestmark = pytest.mark.usefixtures("warm_launches")
HANG_TIMEOUT_S = 6  # each run below is stuck as soon as it starts: this only has to outlast a start under load

PREAMBLE = """\
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(3):
    dist.all_reduce(torch.ones(4))
"""  # the scripts below start at line 8, after three collectives every rank called

HANGS = {
    "a collective one rank skips": (
        """\
if rank == 0:
    dist.all_reduce(torch.ones(4))
else:
    dist.barrier()
""",
        # rank 1's barrier is collective #4 too: the ranks disagree at #4
        "The ranks disagree at collective #4: all_reduce of [4] float32 on rank 0 (line 9), barrier on rank 1 (line 11).",
    ),
    "a collective one rank never calls": (
        """\
if rank == 0:
    dist.all_reduce(torch.ones(4))
time.sleep(300)
""",
        "Rank 1 never called all_reduce #4, which rank 0 is waiting in (line 9): rank 1 is in your code at line 10",
    ),
    "mismatched shapes": (
        """\
dist.all_reduce(torch.ones(4 if rank == 0 else 3))
time.sleep(300)
""",
        "The ranks disagree at collective #4: all_reduce of [4] float32 on rank 0 (line 8), all_reduce of [3] float32 on "
        "rank 1 (line 8).",
    ),
    "send and recv both receiving": (
        """\
dist.recv(torch.empty(4), src=1 - rank)
""",
        "Ranks 0 and 1 both wait in recv (line 8), and no rank sends",
    ),
    "a rank stuck in plain Python": (
        """\
while rank == 1: step += 1  # noqa: E701 - one line, so that the stack names it whichever part runs
dist.barrier()
""",
        "Rank 1 never called barrier #4, which rank 0 is waiting in (line 9): rank 1 is in your code at line 8, "
        "in no collective",
    ),
    "a barrier one rank never reaches because it raised": (
        """\
import traceback
try:
    if rank == 1:
        raise ValueError("bad batch")
    dist.barrier()
except ValueError:
    traceback.print_exc()  # handled: the rank goes on, and rank 0 waits in the barrier for ever
time.sleep(300)  # the rank's next work (on gloo, a rank that exits closes its connections: the others fail)
""",
        "Rank 1 never called barrier #4, which rank 0 is waiting in (line 12): rank 1 is in your code at line 15, "
        "in no collective (it printed ValueError: bad batch)",
    ),
}


@pytest.mark.parametrize("name", list(HANGS))
def test_a_hang_is_reported_with_its_cause(name, write_script, capsys):
    body, cause = HANGS[name]
    script = write_script("hangs", PREAMBLE + body)
    run = run_on_cpu(script, timeout_s=HANG_TIMEOUT_S)
    assert run.timed_out and run.hang is not None, failure_report(run)
    assert cause in run.hang.cause, f"{run.hang.text()}\n{failure_report(run)}"
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)
    assert "What each rank was waiting in when the run timed out:" in shown and run.hang.cause in shown, shown
    assert shown.index(run.hang.cause) < shown.index("where rank 0 was"), "the report comes before the stacks"
    if name == "a collective one rank never calls":  # torch's own analyser reads the dumps kept, and agrees
        analysed = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                   str(Path(run.config.run_dir) / "flight_recorder"), "--prefix", "rank"],
                                  capture_output=True, text=True, timeout=120)
        assert "missing ranks: {1}" in analysed.stdout + analysed.stderr, analysed.stdout + analysed.stderr
    if name == "a rank stuck in plain Python":
        assert run.hang.ranks[1].waiting_in == "not in a collective (running Python)", run.hang.text()
    assert all(r.exit_code != 139 for r in run.ranks), "no rank may crash while it reports"


def test_a_run_that_finishes_has_no_hang_report(write_script):
    run = run_on_cpu(write_script("finishes", PREAMBLE + "dist.destroy_process_group()\n"))
    assert run.ok and run.hang is None, failure_report(run)


def test_the_report_is_data_a_checker_can_read():
    # Rank 0 waits in all_reduce #2 of the world; rank 1 did collective #1 and is elsewhere.
    collective = {"op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "group": "world"}
    answers = {0: {"collectives": [{**collective, "number": 1, "returned": True},
                                   {**collective, "number": 2, "returned": False}], "point_to_point": None},
               1: {"collectives": [{**collective, "number": 1, "returned": True}], "point_to_point": None}}
    report = build_report(answers, {0: "line 9", 1: "line 12"}, {}, {})
    assert report.ranks == (RankState(0, "all_reduce", "#2", "[4] float32", "world", "line 9"),
                            RankState(1, "not in a collective (running Python)", line="line 12"))
    assert report.cause.startswith("Rank 1 never called all_reduce #2, which rank 0 is waiting in (line 9)")
    assert "rank  waiting in" in report.table()


def test_a_rank_that_returned_from_a_mismatched_collective_is_said_to_have_gone_on():
    # Lesson 5's exercise: rank 0 averaged a scalar loss (#4) while rank 1 all-reduced a gradient; gloo let
    # rank 0 return, and it waits in #5 now.
    def call(number, shape, returned):
        return {"op": "all_reduce", "shapes": [shape], "dtypes": ["Float"], "group": "world", "number": number,
                "returned": returned}

    answers = {0: {"collectives": [call(4, [], True), call(5, [1, 4], False)], "point_to_point": None},
               1: {"collectives": [call(4, [1, 4], False)], "point_to_point": None}}
    report = build_report(answers, {0: "line 36", 1: "line 36"}, {}, {})
    assert report.cause.startswith("The ranks disagree at collective #4: all_reduce of [] (a scalar) float32 on rank 0")
    assert report.cause.endswith(" Rank 0 returned from it anyway (gloo can pair collectives that do not match) and "
                                 "went on."), report.cause


def test_a_rank_that_did_not_answer_is_never_said_to_wait_in_nothing():
    # Rank 0 waits in all_reduce but its answer came too late (a cold rank under load); rank 1 sleeps.
    answers = {0: None, 1: {"collectives": [], "point_to_point": None}}
    report = build_report(answers, {0: "line 9", 1: "line 10"}, {}, {})
    assert report.ranks[0].waiting_in == "did not answer"
    assert "No rank waits in a collective" not in report.cause, report.cause
    assert report.cause.startswith("Rank 0 did not say what it waits in (no answer in time): read its stack below."), \
        report.cause


@pytest.mark.parametrize("name", ["a collective one rank never calls", "mismatched shapes"])
def test_a_cold_launchs_hang_is_reported_as_a_warm_ones(name, write_script, capsys):
    """A cold rank imports what the flight recorder's dump needs as its process group starts, so it answers in time.
    Stopped once both ranks hang (the report a timeout gives, without waiting out a timeout long enough for a cold
    start under load)."""
    body, cause = HANGS[name]
    script = write_script("hangs", PREAMBLE.replace("rank = dist.get_rank()", "rank = dist.get_rank()" + IN_THE_HANG) + body)
    shown = stopped_once_the_ranks_hang(script, capsys, cold=True)
    # Pressed half a second into the hang, a cold rank may answer before its probe has the recorder's line numbers
    # at hand (they come from its stack then): the cause is judged without them.
    def without_lines(text: str) -> str:
        return re.sub(r" \(line \d+\)", "", text)

    assert "What each rank was waiting in when the run was stopped:" in shown, shown
    assert without_lines(cause) in without_lines(shown), shown
    assert "did not answer" not in shown, shown


SHORT_PREAMBLE = """\
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
"""  # the scripts below start at line 6
# What the flight recorder alone cannot tell: the report must agree with the ranks' own stacks.
AGREES_WITH_THE_STACKS = {
    "a subgroup's collective against the world's": (
        """\
sub = dist.new_group([0, 1])
if rank == 0:
    dist.all_reduce(torch.ones(4), group=sub)
else:
    dist.all_reduce(torch.ones(4))
time.sleep(300)
""", {},
        "The ranks wait in collectives of different groups: rank 0 in all_reduce #1 of group 1 (line 8), rank 1 in "
        "all_reduce #1 of the world (line 10)."),
    "an async all_reduce never waited on": (
        """\
if rank == 0:
    work = dist.all_reduce(torch.ones(4), async_op=True)
time.sleep(300)
""", {},
        "Rank 1 never called all_reduce #1, which rank 0 started at line 7 and has not finished (async_op=True, never "
        "waited on, or a GPU stream; line 8 now)"),
    "irecv().wait()": (
        """\
if rank == 0:
    dist.irecv(torch.empty(4), src=1).wait()
time.sleep(300)
""", {},
        "Rank 0 waits in irecv from rank 1 (line 7), and rank 1 is in your code at line 8, in no collective."),
    "the flight recorder off": (
        """\
if rank == 0:
    dist.all_reduce(torch.ones(4))
time.sleep(300)
""", {"TORCH_FR_BUFFER_SIZE": "0"},
        "The flight recorder is off (TORCH_FR_BUFFER_SIZE=0), so the report cannot tell which collective ranks 0 and "
        "1 wait in: read the stacks below (rank 0 at line 7; rank 1 at line 8)."),
    "a huge flight recorder": (
        """\
if rank == 0:
    dist.all_reduce(torch.ones(4))
time.sleep(300)
""", {"TORCH_FR_BUFFER_SIZE": "1000000"},
        "Rank 1 never called all_reduce #1, which rank 0 is waiting in (line 7): rank 1 is in your code at line 8"),
}


@pytest.mark.parametrize("name", list(AGREES_WITH_THE_STACKS))
def test_the_report_agrees_with_the_ranks_stacks(name, write_script, capsys):
    body, env, cause = AGREES_WITH_THE_STACKS[name]
    if not env:
        run = run_on_cpu(write_script("hangs", SHORT_PREAMBLE + body), timeout_s=HANG_TIMEOUT_S)
        assert run.timed_out and run.hang is not None, failure_report(run)
        assert cause in run.hang.cause, f"{run.hang.text()}\n{failure_report(run)}"
        return
    # A TORCH_* variable of the cell's own launches cold (torch may read it at import): stopped once both ranks
    # hang, however long a cold start under load takes.
    script = write_script("hangs", SHORT_PREAMBLE.replace("rank = dist.get_rank()", "rank = dist.get_rank()" + IN_THE_HANG) + body)
    shown = stopped_once_the_ranks_hang(script, capsys, extra_env=env)
    assert cause in " ".join(shown.split()), shown


def test_a_cells_lines_are_named_as_the_cells():
    """A script written from a %%torchrun cell: its lines are the cell's, and the report says so."""
    collective = {"op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "group": "world"}
    answers = {0: {"collectives": [{**collective, "number": 1, "returned": False, "line": 9}], "point_to_point": None},
               1: {"collectives": [], "point_to_point": None}}
    report = build_report(answers, {0: "line 9 of the cell", 1: "line 12 of the cell"}, {}, {}, in_cell=True)
    assert report.ranks[0].line == "line 9 of the cell"
    assert report.cause.startswith("Rank 1 never called all_reduce #1, which rank 0 is waiting in (line 9 of the "
                                   "cell): rank 1 is in your code at line 12 of the cell"), report.cause


def test_a_cell_run_by_the_magic_names_the_line_of_the_cell(write_script):
    from ddp_helpers.cells import write_cell_script

    script = write_script("placeholder", "")
    write_cell_script(PREAMBLE + HANGS["a collective one rank never calls"][0], script, origin="lesson.ipynb",
                      name="hangs")
    run = run_on_cpu(script, timeout_s=HANG_TIMEOUT_S)
    assert run.timed_out and run.hang is not None, failure_report(run)
    # The header line stands where the %%torchrun line does: the script's line 10 is the cell's line 10.
    assert "which rank 0 is waiting in (line 10 of the cell): rank 1 is in your code at line 11 of the cell" \
        in run.hang.cause, run.hang.text()


def test_a_rank_still_importing_at_the_timeout_is_said_to_be_starting(write_script):
    """A cold rank under load can still be in `import torch` when the timeout comes: not a loop or a sleep."""
    script = write_script("starts", "import os, sys\n"
                                    "sys.path.insert(0, os.path.join(os.path.dirname(__file__), 'site-packages'))\n"
                                    "import slow_to_import  # an installed library, slow to import (torch, under load)\n")
    (script.parent / "site-packages").mkdir()
    (script.parent / "site-packages" / "slow_to_import.py").write_text("import time\ntime.sleep(300)\n")
    run = run_on_cpu(script, timeout_s=HANG_TIMEOUT_S)
    assert run.timed_out and run.hang is not None, failure_report(run)
    assert run.hang.cause.startswith("No rank waits in a collective: ranks 0 and 1 were still starting, importing "
                                     "(rank 0 at line 3; rank 1 at line 3)"), run.hang.text()
    assert "raise --timeout" in run.hang.cause and "a loop that does not end" not in run.hang.cause


IN_THE_HANG = "; print('in the hang', flush=True)"  # appended to a line: the scripts' line numbers stay


def stopped_once_the_ranks_hang(script: Path, capsys, **options) -> str:
    """Run `script` (both ranks print 'in the hang' just before it) and press stop (a KeyboardInterrupt in the
    kernel, as Ctrl-C in the terminal runner) half a second after both printed it, however long their start took:
    what the launcher printed (its report), once the interrupt went on."""
    import _thread
    import threading
    import time

    run_dir = script.parent / "run"
    pressed = threading.Event()

    def press_stop_once_the_ranks_hang():
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and not all(
                (run_dir / f"rank{r}.stdout").exists() and "in the hang" in (run_dir / f"rank{r}.stdout").read_text()
                for r in (0, 1)):
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0 inside its collective
        pressed.set()
        _thread.interrupt_main()

    threading.Thread(target=press_stop_once_the_ranks_hang, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_on_cpu(script, timeout_s=120, run_dir=run_dir, **options)
    assert pressed.is_set() and time.monotonic() - started < 110, "stopped by the press, before the timeout"
    return re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)


@pytest.mark.parametrize("cold", [False, True])
def test_pressing_stop_shows_where_each_rank_was_then_stops_the_run(write_script, capsys, cold):
    """The stop button long before the timeout: the same report a timeout gives, then the run is stopped and the
    interrupt goes on."""
    from ddp_helpers.processes import process_is_dead

    body, cause = HANGS["a collective one rank never calls"]
    script = write_script("hangs", PREAMBLE.replace("rank = dist.get_rank()", "rank = dist.get_rank()" + IN_THE_HANG) + body)
    shown = stopped_once_the_ranks_hang(script, capsys, cold=cold)
    assert "[ddp_helpers] stopped: asking every live rank for its stack" in shown, shown
    assert "What each rank was waiting in when the run was stopped:" in shown and cause in shown, shown
    # Every rank that started (it wrote who it is) is gone.
    pids = [json.loads(p.read_text())["pid"] for p in (script.parent / "run").glob("rank*.identity.json")]
    assert len(pids) == 2 and all(process_is_dead(pid) for pid in pids), pids


def test_the_waiting_lines_clause_names_each_ranks_unfinished_call_and_groups_ranks_alike():
    from ddp_helpers.hang import unfinished_line

    def collective(op, number, returned, group="world"):
        return {"op": op, "number": number, "returned": returned, "group": group, "shapes": [[3]], "dtypes": ["float"]}

    answers = {
        0: {"collectives": [collective("barrier", 0, True), collective("all_reduce", 1, False)], "recorder": True},
        1: {"collectives": [collective("barrier", 0, True)], "recorder": True,
            "point_to_point": {"op": "recv", "peer": 3, "number": 2, "shape": [3], "dtype": "float32"}},
        2: {"collectives": [collective("all_reduce", 1, False)], "recorder": True},
        3: {"collectives": [collective("all_gather", 4, False, group="tp")], "recorder": True},
        4: {"collectives": [collective("barrier", 0, True)], "recorder": True},
        5: {"collectives": [], "recorder": False},
    }
    assert unfinished_line(answers) == ("not finished: ranks 0 and 2 all_reduce #1; rank 1 recv from rank 3; "
                                        "rank 3 all_gather #4 (tp); rank 4 no collective; "
                                        "rank 5 unknown (the flight recorder is off)")
    assert unfinished_line({}) == ""
