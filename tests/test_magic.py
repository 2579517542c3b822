"""The %%torchrun magic in a real IPython shell: options, bad input, and results left in variables."""

import os
import re

import pytest
from IPython.core.error import UsageError

from ddp_helpers.default_job import detect_hardware
from ddp_helpers.result import RunFailed
from support import printed_by_the_script

GPUS = detect_hardware().gpu_count
# Asking nccl for more ranks than GPUs: without GPUs any nccl launch; with k GPUs, k + 1 ranks.
NCCL_TOO_MANY = (
    ("--backend nccl", r"needs CUDA GPUs.*--backend gloo") if GPUS == 0
    else (f"--backend nccl -n {GPUS + 1}", rf"{GPUS + 1} ranks asked for but only {GPUS} GPU.*--backend gloo")
)


def run_cell(shell, line: str, body: str):
    return shell.run_cell(f"%%torchrun {line}\n{body}")


def test_help_lists_the_options_and_launches_nothing(ipython, capsys, tmp_path):
    result = run_cell(ipython, "--help", "raise SystemExit('must not run')")
    assert result.success
    shown = capsys.readouterr().out
    for option in ("--nproc", "--name", "--timeout", "--out", "--backend"):
        assert option in shown
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("cell", ["%%torchrun --help", "%%torchrun -h\n\n", "%torchrun --help"])
def test_help_alone_in_a_cell_or_as_a_line_magic_prints_the_options(ipython, capsys, cell):
    result = ipython.run_cell(cell)
    assert result.success, result.error_in_exec or result.error_before_exec
    assert "--nproc" in capsys.readouterr().out


def test_the_line_magic_without_help_says_how_to_run_a_cell(ipython):
    result = ipython.run_cell("%torchrun -n 2")
    assert "start a cell with %%torchrun" in str(result.error_in_exec)


@pytest.mark.parametrize(
    "line, message",
    [
        ("--bogus 3", r"unrecognized arguments: --bogus 3 \(%%torchrun --help"),
        ("-n abc", r"nproc must be a whole number .*got 'abc'"),
        ("-n 0", r"nproc must be 1 or more"),
        ("-n -1", r"nproc must be 1 or more"),
        NCCL_TOO_MANY,
        ("--name ../escape", r"--name must be letters"),
        ("--out 1x", r"--out must be a Python variable name"),
        ("--out class", r"--out must be a Python variable name"),
        ("--out print", r"--out 'print' would replace Python's built-in print.*such as print_run"),
        ("--out get_ipython", r"--out 'get_ipython' would replace IPython's own get_ipython"),
        ("--out Out", r"would replace IPython's own Out"),
        ("--out _3", r"would replace IPython's own _3"),
        ("--nnodes 0", r"nnodes must be a whole number of agents from 1 to 8"),
        ("--nodes 2", r"--nodes is for Slurm jobs \(--slurm\), not for runs on this machine"),
        ("--slurm --nodes 0", r"slurm nodes must be a whole number from 1 to 64"),
        ("--env NOEQUALS", r"--env takes NAME=VALUE"),
        ("--kill-rank 1", r"kill_rank and kill_after go together"),
        ("-n 2 --kill-rank 5 --kill-after 'step 1'", r"kill_rank must be a rank of this run, 0 to 1, got '5'"),
        # Its script would come first on the ranks' sys.path: torch's own `import logging` would get the cell.
        ("--name logging", r"--name 'logging' would shadow the module 'logging'.*such as logging_cell"),
        ("--name numpy", r"--name 'numpy' would shadow the module 'numpy'"),
        ("--name plots", r"--name 'plots' is taken"),
        ("--name " + "x" * 245, r"--name is at most 100 characters"),
        ("--env GLOO_SOCKET_IFNAME=eth0", r"may not set GLOO_SOCKET_IFNAME for a run on this machine.*loopback"),
        ("--env NCCL_SOCKET_IFNAME=eth0", r"may not set NCCL_SOCKET_IFNAME"),
        ("--env PYTHONUNBUFFERED=0", r"may not set PYTHONUNBUFFERED"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_runs(ipython, tmp_path, line, message):
    result = run_cell(ipython, f"--backend gloo {line}" if "backend" not in line else line, "print('ran')")
    assert isinstance(result.error_in_exec, UsageError)
    assert re.search(message, str(result.error_in_exec)), str(result.error_in_exec)
    assert not list((tmp_path / "runs").glob("*/*/rank0.stdout")), "nothing may be launched"


def test_a_syntax_error_is_shown_with_its_line_and_nothing_is_written(ipython, tmp_path, capsys):
    result = run_cell(ipython, "-n 2 --backend gloo --name broken", "x = 1\ny = (\n")
    assert isinstance(result.error_in_exec, UsageError)
    # Numbered as JupyterLab numbers the cell's lines (and as the ranks' tracebacks are): %%torchrun is line 1.
    assert "line 3" in str(result.error_in_exec)
    shown = capsys.readouterr().err
    assert "SyntaxError" in shown and 'line 3' in shown
    assert not (tmp_path / "runs").exists()
    ipython_syntax = run_cell(ipython, "-n 2 --backend gloo --name shell", "import torch\n!pip install numpy\n")
    assert re.search(r"syntax error \(line 3 of the cell\).*shell commands \(!\.\.\.\) are IPython's syntax.*cell of their own",
                     str(ipython_syntax.error_in_exec)), ipython_syntax.error_in_exec
    assert not (tmp_path / "runs").exists()


def test_cells_run_on_every_rank_and_failures_fail_the_cell(ipython, tmp_path, capsys, monkeypatch):
    """One successful and one failing cell, sharing a shell: the script file, --out, and the failure."""
    from ddp_helpers import output

    # Hold rank 0's traceback until the run ends however loaded the machine is (test_output tests the release).
    monkeypatch.setattr(output, "HOLD_TRACEBACK_S", 60.0)
    ok = run_cell(
        ipython,
        "-n 2 --backend gloo --name greet --out greeting --cwd .",
        "import os\nfrom ddp_helpers import record\nrecord('rank', int(os.environ['RANK']))\nrecord('cwd', os.getcwd())\n",
    )
    assert ok.success, ok.error_in_exec
    greeting = ipython.user_ns["greeting"]
    assert greeting.facts("rank") == [0, 1]
    assert greeting.facts("cwd") == [os.getcwd()] * 2  # --cwd . : the notebook's (kernel's) folder
    script = tmp_path / "runs" / "notebook" / "scripts" / "greet" / "greet.py"
    assert script.read_text().startswith("# Generated from notebook.ipynb, %%torchrun cell 'greet'")

    capsys.readouterr()
    failed = run_cell(
        ipython,
        "-n 2 --backend gloo --name oops --out oops",
        "import os, torch.distributed as dist\ndist.init_process_group('gloo')\nif os.environ['RANK'] == '1':\n"
        "    raise KeyError('missing column')\ndist.barrier()\n",
    )
    assert isinstance(failed.error_in_exec, RunFailed)
    assert "rank 1 failed first (KeyError" in str(failed.error_in_exec)
    rendered = "\n".join(failed.error_in_exec._render_traceback_())
    shown = capsys.readouterr()
    everything = shown.out + shown.err + rendered
    # The failure once: rank 1's traceback streamed with its prefix, named in the summary as the root cause;
    # rank 0's error in the barrier (a consequence) folded to one line.
    assert everything.count("raise KeyError('missing column')") == 1, everything
    assert "Rank 1 failed first, the root cause: KeyError: 'missing column'" in rendered
    assert "(its traceback is above, under [rank 1])" in rendered
    if ipython.user_ns["oops"].ranks[0].error is not None:  # else torchrun stopped it before it raised
        assert "a consequence of rank 1's failure" in shown.err, shown.err
        assert re.search(r"rank 0: .*a consequence of rank 1's failure", rendered), rendered
        assert shown.err.index("KeyError: 'missing column'") < shown.err.index("a consequence"), shown.err
    assert everything.count("Traceback (most recent call last)") == 1, everything
    # The cell's own line numbers, as JupyterLab shows them (the %%torchrun line is line 1): raise is line 5.
    assert re.search(r'oops\.py", line 5\b', shown.err), shown.err
    assert ipython.user_ns["oops"].first_failure.rank == 1
    assert "missing column" in ipython.user_ns["oops"].ranks[1].stderr  # kept whole in the result


def test_a_cell_that_may_fail_shows_the_failure_and_the_notebook_goes_on(ipython, capsys):
    result = run_cell(ipython, "-n 2 --backend gloo --name demo --out demo --may-fail",
                      "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('the point of the demo')\n")
    assert result.success, result.error_in_exec
    shown = capsys.readouterr().out
    assert "Rank 1 failed first, the root cause: ValueError: the point of the demo" in shown
    assert "--may-fail" in shown
    assert ipython.user_ns["demo"].first_failure.rank == 1


def test_agents_restarts_and_a_killed_rank_from_a_cell(ipython):
    result = run_cell(
        ipython,
        "-n 1 --nnodes 2 --backend gloo --name agents --out agents --max-restarts 1 --kill-rank 1 --kill-after 'ready now'",
        # Rank 1 is killed while rank 0 waits for it in a barrier (a membership change restarts agent 0's
        # rank without counting: it says 'ready now' again, and only rank 1 sleeps to be killed).
        "import os, time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "again = os.environ['TORCHELASTIC_RESTART_COUNT'] != '0'\nprint('again' if again else 'ready now', flush=True)\n"
        "if dist.get_rank() == 1 and not again:\n    time.sleep(30)\n"
        "dist.barrier()\ndist.destroy_process_group()\n",
    )
    assert result.success, result.error_in_exec
    agents = ipython.user_ns["agents"]
    assert sorted(r.agent for r in agents.ranks) == [0, 1] and agents.restarts == 1
    assert printed_by_the_script(agents.ranks[1].attempts[-1]).strip() == "again"


def test_a_cell_never_imports_another_cells_script(ipython, tmp_path):
    # Each cell's script has a folder of its own: `import stage_one` finds the learner's own stage_one.py
    # in the working directory (--cwd), never the script of the cell named stage_one.
    first = run_cell(ipython, "-n 2 --backend gloo --name stage_one --out first", "WHO = 'the cell'\n")
    assert first.success, first.error_in_exec
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "stage_one.py").write_text("WHO = 'my own file'\n")
    second = run_cell(ipython, f"-n 2 --backend gloo --name stage_two --out second --cwd {tmp_path / 'work'}",
                      "import stage_one\nfrom ddp_helpers import record\nrecord('who', stage_one.WHO)\n")
    assert second.success, second.error_in_exec
    assert ipython.user_ns["second"].facts("who") == ["my own file"] * 2


def test_a_module_beside_the_notebook_imports_in_a_cell_as_in_the_kernel(ipython, tmp_path, monkeypatch):
    # Jupyter starts the kernel in the notebook's folder, and `import model` there finds model.py beside
    # the notebook: the cell's ranks (whose script lives in the run folder) find it too.
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "model_beside.py").write_text("WHO = 'beside the notebook'\n")
    monkeypatch.chdir(tmp_path / "course")
    result = run_cell(ipython, "-n 2 --backend gloo --name beside --out beside",
                      "import model_beside\nfrom ddp_helpers import record\nrecord('who', model_beside.WHO)\n")
    assert result.success, result.error_in_exec
    assert ipython.user_ns["beside"].facts("who") == ["beside the notebook"] * 2


def test_env_values_may_hold_spaces_quoted_as_in_a_shell(ipython):
    result = run_cell(ipython, "-n 2 --backend gloo --name spaced --out spaced --env 'MSG=hello world' --env WHO='the cell'",
                      "import os\nfrom ddp_helpers import record\nrecord('env', [os.environ['MSG'], os.environ['WHO']])\n")
    assert result.success, result.error_in_exec
    assert ipython.user_ns["spaced"].facts("env") == [["hello world", "the cell"]] * 2


def test_a_cell_without_a_name_is_named_after_its_notebook_cell():
    # Re-running the same cell must reuse its folder, not add cell12, cell13, ... (JupyterLab and nbclient
    # send the cell's id with every execution).
    from ddp_helpers.magic import _default_cell_name

    class Shell:
        execution_count = 7

        def __init__(self, metadata):
            self.metadata = metadata

        def get_parent(self):
            return {"metadata": self.metadata}

    assert _default_cell_name(Shell({"cellId": "3e9a9e5e-1f"})) == "cell-3e9a9e5e-1f"
    assert _default_cell_name(Shell({})) == "cell7"
    assert _default_cell_name(Shell({"cellId": "../../etc"})) == "cell7"


def test_the_stop_button_ends_the_cell_with_one_line(ipython):
    # The stop button is an interrupt: the run is stopped and swept, and the learner reads one line that says
    # so, not a KeyboardInterrupt traceback through the launcher. The cell still fails ("Run All" stops).
    import _thread
    import signal
    import threading

    from ddp_helpers.magic import RunStopped

    # As a Jupyter kernel handles SIGINT, whatever started the tests (interrupt_main does nothing while the
    # signal is ignored, as in a background job of a script).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(5.0, _thread.interrupt_main)
    timer.start()
    try:
        result = run_cell(ipython, "-n 2 --backend gloo --name sleeper --out sleeper", "import time\ntime.sleep(120)\n")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    error = result.error_in_exec
    assert isinstance(error, RunStopped), error
    (line,) = error._render_traceback_()
    assert re.match(r"sleeper\.py stopped after \d+\.\d s by an interrupt .*nothing is left running\.$", line), line


def test_a_cell_that_may_fail_says_so_before_it_runs(ipython, capsys):
    result = run_cell(ipython, "-n 2 --backend gloo --name bound_to_fail --out failing --may-fail",
                      "raise SystemExit(3)\n")
    assert result.success
    shown = capsys.readouterr().out
    assert shown.index("--may-fail: this cell may fail") < shown.index("the failure was expected here")


def test_loading_the_extension_again_is_quiet(ipython, capsys):
    """Run All a second time in one kernel runs %load_ext again: no "already loaded" note, the magic still works."""
    ipython.extension_manager.loaded.discard("ddp_helpers")  # as in a kernel whose first cell has not run yet
    capsys.readouterr()
    for _ in range(3):  # the first cell, then Run All twice more
        result = ipython.run_cell("%load_ext ddp_helpers")
        assert result.success
    assert "already loaded" not in capsys.readouterr().out
    assert ipython.run_cell("%torchrun --help").success
    assert "--nproc" in capsys.readouterr().out
