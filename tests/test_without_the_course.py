"""The launcher is a library of its own (issue 51): with the course package removed, a plain `%%torchrun` cell and a
`run_script` launch both work, warm and cold: each rank's output, recorded facts, a restart after a rank died, and
the hang report of a run stopped at its timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KERNEL = textwrap.dedent('''
    import contextlib, importlib.util, io, json, os, signal, sys, threading, time
    from pathlib import Path
    assert importlib.util.find_spec("ddp_helpers.course") is None, "the course is importable"
    from IPython.core.interactiveshell import InteractiveShell
    from ddp_helpers import run_script

    CELL = """
    import os, sys
    import torch, torch.distributed as dist
    from ddp_helpers import record
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os._exit(3)  # the first attempt dies: torchrun starts both ranks again
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print("sum is", total.item())
    record("sum", total.item())
    record("loaded", sorted(m for m in sys.modules if m.startswith("ddp_helpers")))
    dist.destroy_process_group()
    """
    HANG = """
    import pathlib, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print("before the all_reduce", flush=True)
    pathlib.Path(MARKS, f"rank{rank}").touch()
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never calls it
    else:
        time.sleep(600)
    """
    marks = Path(sys.argv[1]) / "marks"
    marks.mkdir()
    HANG = HANG.replace("MARKS", repr(str(marks)))


    def stop_when_both_wait():
        """The stop button, once both ranks are where the hang holds them (however long a cold start takes)."""
        while len(list(marks.iterdir())) < 2:
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)


    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_helpers")
    seen = {}
    for how in ("warm", "cold"):
        cold = " --cold" if how == "cold" else ""
        shell.run_cell_magic("torchrun", f"-n 2 --backend gloo --max-restarts 1 --timeout 150{cold} --out run", CELL)
        run = shell.user_ns["run"]
        seen[f"cell {how}"] = {"ok": run.ok, "restarts": run.restarts, "stdout": [r.stdout for r in run.ranks],
                               "sum": run.facts("sum"), "loaded": run.facts("loaded"),
                               "files": sorted(path.name for path in run.run_dir.iterdir())}
    script = Path(sys.argv[1]) / "hang.py"
    script.write_text(HANG)
    # Warm: stopped at its timeout. Cold: stopped by the stop button once both ranks wait (a cold start under load
    # can take longer than any short timeout).
    run = run_script(script, nproc=2, backend="gloo", timeout_s=15, stream=False)
    seen["hang warm"] = {"timed_out": run.timed_out, "stdout": [r.stdout for r in run.ranks],
                         "hang": run.hang.text() if run.hang else None}
    for mark in marks.iterdir():
        mark.unlink()
    threading.Thread(target=stop_when_both_wait, daemon=True).start()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            run_script(script, nproc=2, backend="gloo", timeout_s=300, cold=True)
    except KeyboardInterrupt:
        pass
    seen["hang cold"] = {"timed_out": True, "stdout": [printed.getvalue()] * 2, "hang": printed.getvalue()}
    print("SEEN" + json.dumps(seen))
''')


def package_without_the_course(folder: Path) -> Path:
    shutil.copytree(ROOT / "ddp_helpers", folder / "ddp_helpers",
                    ignore=shutil.ignore_patterns("course", "__pycache__"))
    return folder


def test_the_launcher_works_with_the_course_package_removed(tmp_path):
    place = package_without_the_course(tmp_path / "library")
    env = {**os.environ, "PYTHONPATH": str(place)}  # before the installed project: its course is out of reach
    done = subprocess.run([sys.executable, "-c", KERNEL, str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=480)
    assert done.returncode == 0 and "SEEN" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
    seen = json.loads(done.stdout.split("SEEN", 1)[1])
    for how in ("warm", "cold"):
        cell = seen[f"cell {how}"]
        assert cell["ok"] and cell["restarts"] == 1, cell
        assert cell["sum"] == [3.0, 3.0] and all("sum is 3.0" in out for out in cell["stdout"]), cell
        assert all(not any(m.startswith("ddp_helpers.course") for m in loaded) for loaded in cell["loaded"]), cell
        kept = [name for name in cell["files"] if re.fullmatch(r"rank\d+\.(secret|crossings|writes\.json|p2p\.json)", name)]
        assert kept == [], "a plain launch keeps none of the course's records"
        hang = seen[f"hang {how}"]
        assert hang["timed_out"] and all("before the all_reduce" in out for out in hang["stdout"]), hang
        assert hang["hang"] and "all_reduce" in hang["hang"] and "rank 1" in hang["hang"], hang
