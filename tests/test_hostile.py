"""The launcher used as a hostile (or just unlucky) user would: it never deletes the user's files, never
mixes two launches' results, never loses a run over one bad recorded value, bounds endless output,
names every failure, and ends a script as plain torchrun would."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddp_helpers import LaunchError, RunFailed
from ddp_helpers.cells import notebook_key
from ddp_helpers.run_folder import runs_root
from ddp_helpers.engines.local.engine import HANG_REPORT_WAIT_S, STACK_DUMP_WAIT_S, STOP_BOUND_S
from ddp_helpers.private_folders import claim_run_folder
from ddp_helpers.run_folder import MARKER_NAME, RankErrorRecord, RunFolder
from support import failure_report, run_on_cpu


# ---- 1 and 8: nothing of the user's deleted; working directory ------------------------------------

WHERE_AM_I = """
import os
from ddp_helpers import record
record("cwd", os.getcwd())
if os.path.exists("input.txt"):
    record("input", open("input.txt").read())
"""


def test_a_launch_never_deletes_the_users_files(write_script, tmp_path):
    script = write_script("data", WHERE_AM_I)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("x,y\n")
    (tmp_path / "input.txt").write_text("beside the notebook")

    run = run_on_cpu(script)
    assert run.ok, failure_report(run)
    assert (tmp_path / "data" / "train.csv").read_text() == "x,y\n", "data/ beside data.py must be left alone"
    assert run.run_dir.is_relative_to(runs_root()), f"default run folder {run.run_dir} should be under the runs root"
    # The ranks run in the (fresh) run folder by default, so a file beside the script is not found there...
    assert run.facts("cwd") == [str(run.run_dir)] * 2
    assert "input" not in run.ranks[0].facts
    # ... and in a folder of the user's choice with cwd=.
    run = run_on_cpu(script, cwd=tmp_path)
    assert run.ok, failure_report(run)
    assert run.facts("input") == ["beside the notebook"] * 2

    before = sorted(p.name for p in tmp_path.iterdir())
    for folder in (tmp_path, tmp_path / "data", script):
        with pytest.raises(LaunchError, match="did not create"):
            run_on_cpu(script, run_dir=folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "data" / "train.csv").exists() and script.exists()


def test_two_scripts_with_one_name_get_two_run_folders(tmp_path):
    from ddp_helpers.run_folder import default_run_dir

    assert default_run_dir(tmp_path / "a" / "train.py") != default_run_dir(tmp_path / "b" / "train.py")


def test_a_run_folder_we_made_is_emptied_at_the_next_launch_and_only_then(tmp_path):
    path = tmp_path / "run"
    with claim_run_folder(path) as folder:
        folder.start_launch("first")
        (path / "stale.txt").write_text("from the first launch")
    assert (path / MARKER_NAME).is_file()
    with claim_run_folder(path) as folder:
        assert (path / "stale.txt").exists(), "claiming alone must not delete anything"
        folder.start_launch("second")
        assert not (path / "stale.txt").exists()


# ---- 2: results never mix ----------------------------------------------------------------------------

def test_notebooks_with_one_name_in_two_folders_have_two_run_folders(tmp_path):
    assert notebook_key(tmp_path / "a" / "lesson.ipynb") != notebook_key(tmp_path / "b" / "lesson.ipynb")
    assert notebook_key(None) == "notebook"


def test_a_second_launch_into_a_busy_run_folder_is_refused(write_script, tmp_path):
    script = write_script("slow", "import time\ntime.sleep(4)\n")
    first = {}
    runner = threading.Thread(target=lambda: first.setdefault("run", run_on_cpu(script, run_dir=tmp_path / "run")))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "torchrun.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LaunchError, match="in use by another launch"):
            run_on_cpu(script, run_dir=tmp_path / "run")
    finally:
        runner.join()
    assert first["run"].ok, failure_report(first["run"])


def test_files_of_another_launch_are_not_read_back(tmp_path):
    with claim_run_folder(tmp_path / "run") as folder:
        folder.start_launch("mine")
        other = RunFolder(folder.path, "someone-else")
        other.write_error(RankErrorRecord(rank=0, time=0, type="X", message="", traceback=""))
        assert folder.read_error(0) is None
        folder.write_error(RankErrorRecord(rank=1, time=0, type="Y", message="", traceback=""))
        assert folder.read_error(1).type == "Y"


NOTEBOOK_KERNEL = textwrap.dedent(
    """
    import json, sys
    from IPython.testing.globalipapp import start_ipython
    shell = start_ipython()
    shell.user_ns["__session__"] = sys.argv[1]
    shell.run_line_magic("load_ext", "ddp_helpers")
    cell = "import time\\nfrom ddp_helpers import record\\nrecord('who', %r)\\nprint('I am', %r)\\ntime.sleep(2)\\n"
    result = shell.run_cell("%%torchrun -n 2 --backend gloo --name same --out run\\n" + cell % (sys.argv[2], sys.argv[2]))
    run = shell.user_ns.get("run")
    print("RESULT " + json.dumps({"ok": result.success, "who": run.facts("who") if run else None,
                                   "stdout": [r.stdout for r in run.ranks] if run else None,
                                   "run_dir": str(run.run_dir) if run else None}))
    """
)


def test_two_notebooks_with_one_name_running_the_same_cell_at_once_see_only_their_own_run(tmp_path):
    kernels = {
        who: subprocess.Popen(
            [sys.executable, "-c", NOTEBOOK_KERNEL, str(tmp_path / folder / "lesson.ipynb"), who],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for who, folder in (("A", "course"), ("B", "copy"))
    }
    results = {}
    for who, kernel in kernels.items():
        output, _ = kernel.communicate(timeout=120)
        line = next((l for l in output.splitlines() if l.startswith("RESULT ")), None)
        assert line, output
        results[who] = json.loads(line[len("RESULT "):])
    for who, result in results.items():
        assert result["ok"], result
        assert result["who"] == [who, who]
        assert result["stdout"] == [f"I am {who}\n"] * 2
    assert results["A"]["run_dir"] != results["B"]["run_dir"]


# ---- 3: record() never loses a run -------------------------------------------------------------------

RECORDS_ODD_VALUES = """
import os
import numpy as np
import torch
from ddp_helpers import record
from ddp_helpers.recording import RecordError

rank = int(os.environ["RANK"])
record("loss", np.float32(0.25))
record("step", np.int64(7))
record("flag", np.bool_(True))
record("weights", np.arange(4, dtype=np.float64).reshape(2, 2))
record("mixed", {"t": torch.ones(2), "a": np.arange(3)})
try:
    record("model", torch.nn.Linear(2, 2))
except RecordError as error:
    record("refused", str(error))
# A fact written behind record's back that cannot be read back safely.
class Custom:
    pass
torch.save(Custom(), os.path.join(os.environ["DDP_HELPERS_RUN_DIR"], "facts", f"rank{rank}", "sneaky.pt"))
"""


def test_numpy_values_come_back_and_an_unreadable_fact_loses_nothing_else(write_script):
    import torch

    run = run_on_cpu(write_script("odd_values", RECORDS_ODD_VALUES))
    assert run.ok, failure_report(run)
    assert run.facts("loss") == [0.25, 0.25]
    assert run.facts("step") == [7, 7] and run.facts("flag") == [True, True]
    assert run.facts("weights")[0] == [[0.0, 1.0], [2.0, 3.0]]
    mixed = run.ranks[1].facts["mixed"]
    assert torch.equal(mixed["t"], torch.ones(2)) and torch.equal(mixed["a"], torch.arange(3))
    refused = run.ranks[0].facts["refused"]
    assert "record('model'" in refused and "Linear" in refused and "tensor" in refused
    for rank in run.ranks:
        assert "sneaky" not in rank.facts
        assert "sneaky" in rank.unreadable_facts
    with pytest.raises(KeyError, match="could not be read back"):
        run.facts("sneaky")
    assert "'sneaky' could not be read back" in run.summary()


# ---- 5: endless output is bounded --------------------------------------------------------------------

def test_a_huge_exception_message_is_capped_where_it_is_stored_and_shown(write_script):
    run = run_on_cpu(write_script("huge", """
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("start " + "x" * (10 * 2**20) + " end")
    """), stream=False)
    assert not run.ok and run.first_failure.rank == 1
    error = run.first_failure.error
    assert error.message.startswith("start") and error.message.endswith("end"), "both ends are kept"
    assert "characters dropped here" in error.message and len(error.message) < 100_000
    assert len(error.traceback) < 100_000
    assert (run.run_dir / "rank1.error.json").stat().st_size < 500_000
    assert len(run.summary()) < 500_000


ENDLESS_PRINTER = """
import os, time
line = f"rank {os.environ['RANK']} says something again and again " * 3
for _ in range(40_000):  # about 4.5 MB at once: past the launcher's cap on what it keeps of a stream
    print(line)
while True:  # and never stopping, at a pace that leaves the machine's cores to the rest of the suite
    print(line)
    time.sleep(0.001)
"""

# Long enough for a start on a loaded machine (12 s seen for a cold one in the full suite) plus the second
# or so the ranks need to print past the output cap. The launch is warm: the warm process is up first.
ENDLESS_PRINTER_TIMEOUT_S = 20
MEASURING_LAUNCHER = textwrap.dedent(
    """
    import json, resource, sys, time
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.default_job import Hardware
    from ddp_helpers.default_job import prepare_warm_launches
    assert prepare_warm_launches(), "the warm process did not start"
    config = make_launch_config(sys.argv[1], nproc=2, backend="gloo", hardware=Hardware(()),
                                timeout_s=float(sys.argv[3]), run_dir=sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    run = launch(config)
    print("RESULT " + json.dumps({
        "wall_s": time.monotonic() - start, "timed_out": run.timed_out,
        "grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
        "stdout_sizes": [len(r.stdout) for r in run.ranks], "tail": run.ranks[0].stdout[-300:],
    }))
    """
)


def test_a_rank_printing_forever_costs_bounded_memory_disk_and_time(write_script, tmp_path):
    script = write_script("endless", ENDLESS_PRINTER)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", MEASURING_LAUNCHER, str(script), str(run_dir), str(ENDLESS_PRINTER_TIMEOUT_S)],
        capture_output=True, text=True, timeout=120,
    )
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(line[len("RESULT "):])
    assert result["timed_out"]
    # Ended at its timeout: then at most the hang report's and the stack dumps' waits, and the stop.
    assert result["wall_s"] < ENDLESS_PRINTER_TIMEOUT_S + HANG_REPORT_WAIT_S + STACK_DUMP_WAIT_S + STOP_BOUND_S, result
    assert result["grew_mb"] < 100, result
    for size in result["stdout_sizes"]:
        assert 1_000_000 < size < 2.2 * 2**20, result
    assert "bytes of output dropped here" in done.stdout
    assert "says something again" in result["tail"], "the end of the output is kept"
    on_disk = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    assert on_disk < 10 * 2**20, f"run folder holds {on_disk} bytes"


# ---- 6 and 7: every failure named; a script ends as under plain torchrun -----------------------------

KILLED_BY_A_SIGNAL = """
import os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.{signal_name})
time.sleep(60)
"""


@pytest.mark.parametrize("signal_name, meaning", [("SIGKILL", "out of memory?"), ("SIGSEGV", "native code")])
def test_a_rank_killed_by_a_signal_is_named_as_the_first_failure(write_script, signal_name, meaning):
    run = run_on_cpu(write_script("killed", KILLED_BY_A_SIGNAL.replace("{signal_name}", signal_name)), nproc=3)
    assert not run.ok
    root = run.first_failure
    assert root is not None and root.rank == 1, failure_report(run)
    assert root.status.startswith(f"killed by {signal_name}") and meaning in root.status
    assert [r.status for r in run.ranks if r.rank != 1] == ["stopped (SIGTERM)"] * 2
    assert f"rank 1 failed first (killed by {signal_name}" in str(RunFailed(run))


ENDS_LIKE_PLAIN_PYTHON = """
import atexit, os, sys, threading, time, weakref
rank = int(os.environ["RANK"])

class Kept:
    pass

kept = Kept()  # alive to the end: finalised at exit, as the interpreter does
weakref.finalize(kept, lambda: open(f"finalized{rank}.txt", "w").write("finalizer ran"))
log = open(f"log{rank}.txt", "w")
log.write("written, never closed")
if rank == 0:
    with open("pid_of_the_first.txt", "w") as f:
        f.write(str(os.getpid()))

def first_gone():
    try:
        os.kill(int(open("pid_of_the_first.txt").read()), 0)
        return False
    except (OSError, ValueError):
        return True

def finish_later():
    time.sleep(0.5)
    # Rank 1 fails only once rank 0 has ended (and its agent has seen it, 0.5 s later): torchrun stops
    # every rank still running when one fails.
    deadline = time.monotonic() + 30
    while rank == 1 and not first_gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5 if rank == 1 else 0)
    with open(f"thread{rank}.txt", "w") as f:
        f.write("the thread finished")

threading.Thread(target=finish_later).start()
atexit.register(lambda: open(f"atexit{rank}.txt", "w").write("atexit ran"))
if rank == 0:
    sys.stdout.close()  # the interpreter's exit skips a closed standard stream
sys.exit(256 if rank == 0 else -1)
"""


def test_a_script_ends_as_under_plain_torchrun(write_script):
    run = run_on_cpu(write_script("ends", ENDS_LIKE_PLAIN_PYTHON))
    # The status the OS sees: sys.exit(256) is 0, sys.exit(-1) is 255, as with plain python.
    assert [r.exit_code for r in run.ranks] == [0, 255], failure_report(run)
    assert run.first_failure.rank == 1 and run.first_failure.status == "failed (exit code 255)"
    for rank in (0, 1):
        assert (run.run_dir / f"log{rank}.txt").read_text() == "written, never closed"
        assert (run.run_dir / f"thread{rank}.txt").read_text() == "the thread finished"
        assert (run.run_dir / f"atexit{rank}.txt").read_text() == "atexit ran"
        assert (run.run_dir / f"finalized{rank}.txt").read_text() == "finalizer ran"


def test_plain_python_agrees_on_those_exit_statuses(write_script, tmp_path):
    script = write_script("ends_plain", ENDS_LIKE_PLAIN_PYTHON)
    statuses = [
        subprocess.run([sys.executable, str(script)], env={**os.environ, "RANK": str(rank)}, cwd=tmp_path,
                       timeout=60).returncode
        for rank in (0, 1)
    ]
    assert statuses == [0, 255]
    assert [(tmp_path / f"finalized{rank}.txt").read_text() for rank in (0, 1)] == ["finalizer ran"] * 2


def test_a_folder_is_ours_only_by_our_marker(tmp_path):
    """A user's grammar/ beside their grammar.py whose first line reads "# Generated from" (as ANTLR writes)
    is theirs: refused, never emptied."""
    (tmp_path / "grammar").mkdir()
    (tmp_path / "grammar" / "keep.txt").write_text("mine")
    (tmp_path / "grammar.py").write_text("# Generated from Grammar.g4 by ANTLR 4.13\n")
    with pytest.raises(LaunchError, match="did not create"):
        claim_run_folder(tmp_path / "grammar")
    assert (tmp_path / "grammar" / "keep.txt").read_text() == "mine"


OTHER_RANKS_FILES_READER = """
import os, shutil, sys
from ddp_helpers.course import records
from ddp_helpers.course.evidence_hook import WriteObserver
from ddp_helpers.run_folder import RunFolder

folder = RunFolder(sys.argv[1], "run")
for rank in (*range(9), 13):
    (folder.path / f"rank{rank}.secret").write_text(str(rank))
(folder.path / "rank10.stdout").write_text("rank 10: my number 42")
for rank in (0, 11, 12):
    (folder.path / "facts" / f"rank{rank}").mkdir(parents=True)
    (folder.path / "facts" / f"rank{rank}" / "mean.json").write_text("{}")
(folder.path / "rank9.pt").write_text("a file of the script's own, named like ours")
observer = WriteObserver(folder, rank=0)
sys.addaudithook(observer)
open(folder.path / "rank0.secret").read()  # its own, read: fine
open(folder.path / "rank1.secret").read()
os.close(os.open(str(folder.path / "rank2.secret"), os.O_RDONLY))
os.symlink(folder.path, "folder_by_another_name")
open(os.path.join("folder_by_another_name", "rank3.secret")).read()
os.symlink("rank4.secret", folder.path / "innocent.txt")  # relative: the link's own folder
os.link(folder.path / "rank5.secret", "hard_link")
os.rename(folder.path / "rank6.secret", "moved")
open("planted", "w").write("7")
os.replace("planted", folder.path / "rank7.secret")  # another rank's secret, replaced
open(folder.path / "rank0.secret", "w").write("0")  # its own secret, changed
os.remove(folder.path / "rank8.secret")
open(folder.path / "rank10.stdout").read()
open(folder.path / "facts" / "rank11" / "mean.json").read()
os.symlink(folder.path / "facts" / "rank0", "own_facts")
open(os.path.join("own_facts", "..", "rank12", "mean.json")).read()  # ".." through a link of its own
open(folder.path / "rank9.pt").read()
open(folder.path / "rank0.txt", "w").write("a file the script wrote, named like ours")
shutil.copy(sys.argv[0], "a_copy.py")  # an unrelated file
here, directory = os.getcwd(), os.open(folder.path, os.O_RDONLY)
os.chdir(os.path.dirname(here))
os.close(os.open("rank13.secret", os.O_RDONLY, dir_fd=directory))  # relative to a folder's descriptor
os.chdir(here)
print(list(records.read_crossings(folder, 0)))
print(sorted(os.path.basename(p) for p in observer.paths))
"""


def test_a_rank_going_into_other_ranks_files_is_seen_by_any_route_python_takes(tmp_path):
    """The run folder holds every rank's secret, output and facts (the launcher's bookkeeping): a rank's script
    that opens another's (directly, by a descriptor, through a linked folder or "..", relative to a folder
    descriptor), links or renames it, removes it, plants a file in its place, or changes its own secret, is
    noted for the checkers at once (`records.note_crossing`); reading its own files, and the script's own
    files, are not. A file the script writes is seen as written whatever its name."""
    script = tmp_path / "reader.py"
    script.write_text(OTHER_RANKS_FILES_READER)
    (tmp_path / "run").mkdir()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    crossings, written = done.stdout.strip().splitlines()
    assert eval(crossings) == [  # noqa: S307 - our own script's printed list
        "opened rank1.secret", "opened rank2.secret", "opened rank3.secret", "linked to rank4.secret",
        "linked to rank5.secret", "moved rank6.secret", "replaced rank7.secret", "changed rank0.secret",
        "changed rank8.secret", "opened rank10.stdout", "opened facts/rank11/mean.json",
        "opened facts/rank12/mean.json", "opened rank13.secret"], crossings
    assert "rank0.txt" in eval(written), written  # noqa: S307
