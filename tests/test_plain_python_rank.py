"""A rank looks like plain Python to its script, in the corners a launcher tends to own: the script's own
SIGUSR1 handler, its own sys.excepthook, and where it writes the text --kill-after waits for."""

import re

import pytest

from support import failure_report, run_on_cpu
from ddp_helpers.course.records import records

pytestmark = pytest.mark.usefixtures("warm_launches")

OWNS_SIGUSR1 = """\
import signal, sys, time
import torch
import torch.distributed as dist


def checkpoint_and_leave(signum, frame):  # lesson 4's preemption pattern
    print("checkpoint written", flush=True)
    sys.exit(0)


signal.signal(signal.SIGUSR1, checkpoint_and_leave)
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(4))
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_the_stacks_of_a_timed_out_run_never_run_the_scripts_own_sigusr1_handler(how, write_script, capsys):
    run = run_on_cpu(write_script("owns_usr1", OWNS_SIGUSR1), timeout_s=6 if how == "warm" else 20,
                     cold=how == "cold")
    assert run.timed_out and run.hang is not None, failure_report(run)
    assert all("checkpoint written" not in r.stdout for r in run.ranks), failure_report(run)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)
    for rank, line in ((0, 14), (1, 15)):
        assert "where rank %d was" % rank in shown, shown
        assert f'owns_usr1.py", line {line} in <module>' in run.ranks[rank].stderr, failure_report(run)


REPORTS_ITS_OWN_CRASH = """\
import sys


def report(kind, error, tb):  # a crash reporter
    print(f"REPORTED {kind.__name__}: {error}", file=sys.stderr)


sys.excepthook = report
raise ValueError("bad batch")
"""


@pytest.mark.parametrize("how,then", [("warm", ""), ("cold", ""),
                                      # torch's init_process_group wraps the hook it finds in its own
                                      ("warm", "import torch.distributed as dist\ndist.init_process_group('gloo')\n")])
def test_a_scripts_own_excepthook_runs_as_under_plain_python(how, then, write_script):
    source = REPORTS_ITS_OWN_CRASH.replace("raise ValueError", then + "raise ValueError")
    run = run_on_cpu(write_script("reports", source), cold=how == "cold")
    assert not run.ok
    # Every rank that reached its raise reported it its own way. A rank may not get there: once one rank
    # fails, torchrun stops the others (a cold rank can still be starting then, and ends by SIGTERM).
    raised = [rank for rank in run.ranks if rank.error is not None]
    assert raised and run.first_failure in raised, failure_report(run)
    for rank in raised:
        assert "REPORTED ValueError: bad batch" in rank.stderr, failure_report(run)
    for rank in run.ranks:
        assert "Traceback (most recent call last)" not in rank.stderr, failure_report(run)
    assert run.first_failure.error.type == "ValueError", failure_report(run)


STEPS = """\
import logging, os, subprocess, sys, time
logging.basicConfig(level=logging.INFO)
for step in range(60):
    text = f"step {{step}} done"
    {emit}
    time.sleep(0.05)
"""
EMITTERS = {
    "stderr": "print(text, file=sys.stderr)",
    "logging": "logging.info(text)",
    "stdout's buffer": "sys.stdout.buffer.write(text.encode() + b'\\n'); sys.stdout.buffer.flush()",
    "a subprocess": "subprocess.run(['echo', text], check=True)",
}


@pytest.mark.parametrize("route", list(EMITTERS))
def test_kill_after_watches_everything_the_rank_writes(route, write_script):
    script = write_script("steps", STEPS.format(emit=EMITTERS[route]))
    run = run_on_cpu(script, kill_rank=1, kill_after="step 3 done", timeout_s=60)
    assert not run.ok and run.first_failure is not None and run.first_failure.rank == 1, failure_report(run)
    assert "step 59 done" not in run.ranks[1].stdout + run.ranks[1].stderr, failure_report(run)


def test_kill_after_text_that_never_comes_says_no_rank_was_killed(write_script, capsys):
    script = write_script("steps", STEPS.format(emit="print(text)"))
    run = run_on_cpu(script, kill_rank=1, kill_after="step 99 done", timeout_s=60)
    assert run.ok, failure_report(run)
    assert "rank 1 never printed 'step 99 done' (on stdout or stderr), so no rank was killed" in capsys.readouterr().err


def test_a_timeout_before_any_rank_started_does_not_point_to_stacks(write_script, capsys):
    run = run_on_cpu(write_script("quick", "print('hello')\n"), timeout_s=1e-9, cold=True)
    assert run.timed_out, failure_report(run)
    summary = run.summary()
    assert "No rank had started its script yet" in summary and "shown above" not in summary, summary
    assert "where rank" not in capsys.readouterr().err


COMPILES_AN_ALL_REDUCE = """\
import torch
import torch.distributed as dist
from ddp_helpers import record

dist.init_process_group("gloo")


def step(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


x = torch.ones(4) * (dist.get_rank() + 1)
eager = step(x)  # logged as usual
explained = torch._dynamo.explain(step)(x)
compiled = torch.compile(step, fullgraph=True, backend="eager")(x)
record("seen", {"graph_breaks": explained.graph_break_count, "same": bool(torch.equal(eager, compiled)),
                "value": compiled.tolist()})
dist.destroy_process_group()
"""


def test_torch_compile_traces_all_reduce_as_under_plain_torchrun(write_script):
    """The launcher's all_reduce logger is invisible to the compiler: no graph break, fullgraph=True compiles."""
    run = run_on_cpu(write_script("compiles", COMPILES_AN_ALL_REDUCE), timeout_s=120)
    assert run.ok, failure_report(run)
    assert run.facts("seen") == [{"graph_breaks": 0, "same": True, "value": [7.0] * 4}] * 2
    assert [len(rank.all_reduced) for rank in records(run)] == [1, 1]  # the eager call, logged; compiled ones are not
