"""Warm launches: ranks forked from a process that has torch imported must be the same processes, for
the script, as a cold launch gives, and fall back to cold where they could not be."""

import os
import stat
import textwrap

import pytest

from ddp_helpers.engines.local import warm
from ddp_helpers.run_folder import default_run_dir
from ddp_helpers.run_folder import RunFolder
from ddp_helpers.engines.local.zygote import SUPERVISOR_STOP_S
from ddp_helpers.default_job import prepare_warm_launches
from support import DAEMON_SOURCE, failure_report, run_on_cpu
from ddp_helpers.course.records import records

PROBE = textwrap.dedent(
    """
    import os, random, signal, sys, threading
    import numpy as np
    import torch
    import torch.distributed as dist
    from ddp_helpers import record

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        os.write(write_end, b"x")  # a fresh interpreter ignores SIGPIPE: this raises instead of killing us
        broken_pipe = "written"
    except BrokenPipeError:
        broken_pipe = "BrokenPipeError"
    dist.init_process_group("gloo")
    record("process", {
        "signals": {name: str(signal.getsignal(getattr(signal, name)))
                    for name in ("SIGPIPE", "SIGINT", "SIGXFSZ", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGUSR2")},
        "broken_pipe": broken_pipe,
        "env": dict(os.environ), "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "session_leader": os.getsid(0) == os.getpid(), "torch_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()), "parent": os.getppid(), "main": __name__,
        "random": [torch.randn(1).item(), random.random(), float(np.random.rand())],
    })
    dist.all_reduce(torch.tensor([dist.get_rank() + 1.0]))
    dist.all_reduce(torch.zeros(100), op=dist.ReduceOp.MAX)
    dist.barrier()  # a rank that leaves straight after init can close a pair gloo's peer is still connecting
    dist.destroy_process_group()
    """
)

# Differ between any two launches, warm or cold.
PER_LAUNCH = {"DDP_HELPERS_RUN_ID", "DDP_HELPERS_AGENT_PID", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_ERROR_FILE", "DDP_HELPERS_RANK_SECRET"}


@pytest.fixture(scope="module")
def zygote_pid():
    assert prepare_warm_launches(), "the warm process did not start"
    return warm._ZYGOTE.process.pid


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def processes(run) -> list[dict]:
    assert run.ok, failure_report(run)
    return run.facts("process")


def test_a_warm_rank_is_the_same_process_as_a_cold_one(probe, zygote_pid):
    cold_run, hot_run = run_on_cpu(probe, cold=True), run_on_cpu(probe)
    cold, hot = processes(cold_run), processes(hot_run)
    assert all(p["parent"] == zygote_pid for p in hot), "the second launch should have been warm"
    # What each rank's script handed to all_reduce, seen alike: a small tensor's values, a large one's shape.
    for run in (cold_run, hot_run):
        assert [r.all_reduced for r in records(run)] == [
            ({"shape": [1], "dtype": "float32", "op": "SUM", "values": [rank + 1.0]},
             {"shape": [100], "dtype": "float32", "op": "MAX"}) for rank in (0, 1)]
    assert all(p["parent"] != zygote_pid for p in cold)
    for c, w in zip(cold, hot):
        assert {k: v for k, v in w["env"].items() if k not in PER_LAUNCH} == \
               {k: v for k, v in c["env"].items() if k not in PER_LAUNCH}
        for key in ("argv", "file", "path0", "cwd", "threads", "python_threads", "fds", "session_leader",
                    "torch_threads", "default_dtype", "main", "signals", "broken_pipe"):
            assert w[key] == c[key], f"{key}: warm {w[key]!r}, cold {c[key]!r}"


def test_a_warm_rank_gets_keyboard_interrupt_on_sigint_as_a_cold_one_does(write_script, zygote_pid):
    script = write_script("interrupted", """
        import os, signal
        from ddp_helpers import record
        try:
            os.kill(os.getpid(), signal.SIGINT)
            seen = "no interrupt"
        except KeyboardInterrupt:
            seen = "KeyboardInterrupt"
        record("seen", [seen, os.getppid()])
    """)
    for cold in (True, False):
        run = run_on_cpu(script, cold=cold)
        assert run.ok, failure_report(run)
        assert [seen for seen, _ in run.facts("seen")] == ["KeyboardInterrupt"] * 2
        assert all((parent == zygote_pid) != cold for _, parent in run.facts("seen"))


def test_each_rank_draws_its_own_hash_seed_when_asked(write_script, zygote_pid):
    # Warm ranks share the warm process's string hash seed (a running interpreter cannot draw another):
    # PYTHONHASHSEED=random makes the launch cold, and each rank draws its own, as plain python does.
    script = write_script("hashes", """
        import os
        from ddp_helpers import record
        record("seen", [hash("abc"), os.getppid()])
    """)
    run = run_on_cpu(script, extra_env={"PYTHONHASHSEED": "random"})
    assert run.ok, failure_report(run)
    (hash0, parent0), (hash1, parent1) = run.facts("seen")
    assert hash0 != hash1 and zygote_pid not in (parent0, parent1)


def test_unseeded_randomness_differs_across_ranks_and_launches(probe, zygote_pid):
    first, second = processes(run_on_cpu(probe)), processes(run_on_cpu(probe))
    draws = [tuple(p["random"]) for p in first + second]
    for generator in range(3):  # torch, random, numpy
        values = [d[generator] for d in draws]
        assert len(set(values)) == len(values), f"generator {generator} repeated: {values}"


def test_nothing_carries_over_from_one_warm_launch_to_the_next(write_script, zygote_pid):
    leaves_a_mess = write_script("mess", """
        import os, sys, wave, torch
        torch.set_default_dtype(torch.float64)
        os.environ["LEFT_BEHIND"] = "1"
        sys.modules["torch"].leftover = "set by the previous launch"
        leftover = 1
    """)
    looks = write_script("looks", """
        import os, sys, torch
        from ddp_helpers import record
        record("seen", {"dtype": str(torch.get_default_dtype()), "env": os.environ.get("LEFT_BEHIND"),
                        "module": "wave" in sys.modules, "attribute": hasattr(torch, "leftover"),
                        "global": "leftover" in globals(), "parent": os.getppid()})
    """)
    assert run_on_cpu(leaves_a_mess).ok
    run = run_on_cpu(looks)
    assert run.ok, failure_report(run)
    for seen in run.facts("seen"):
        assert seen["parent"] == zygote_pid
        assert seen == {"dtype": "torch.float32", "env": None, "module": False, "attribute": False,
                        "global": False, "parent": zygote_pid}


def test_an_environment_read_at_import_launches_cold_with_a_note(probe, zygote_pid, capsys):
    run = run_on_cpu(probe, extra_env={"OMP_NUM_THREADS": "2"})
    assert all(p["parent"] != zygote_pid for p in processes(run))
    assert all(p["torch_threads"] == 2 for p in processes(run))
    assert f"{warm.COLD_NOTE}OMP_NUM_THREADS='2' here, " in capsys.readouterr().err
    assert all(p["parent"] != zygote_pid for p in processes(run_on_cpu(probe, cold=True)))


def test_only_this_user_can_reach_the_warm_process(zygote_pid):
    folder = warm._ZYGOTE.folder
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(warm._ZYGOTE.socket_path).st_mode) == 0o600


def test_a_warm_rank_computes_on_several_threads(write_script, zygote_pid):
    # Forking after a parallel region would leave the child's OpenMP pool dead (a deadlock at the next
    # parallel op): the zygote never computes, and a warm rank can use threads as a cold one can.
    run = run_on_cpu(write_script("threads", """
        import os, torch
        from ddp_helpers import record
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        record("result", [float((a @ a).sum()) != 0.0, torch.get_num_threads(), os.getppid()]) 
    """), timeout_s=60)
    assert run.ok, failure_report(run)
    assert run.facts("result") == [[True, 2, zygote_pid]] * 2


def test_a_dead_warm_process_means_one_cold_launch_then_a_new_one(probe, zygote_pid, capsys):
    import signal

    os.kill(zygote_pid, signal.SIGKILL)
    warm._ZYGOTE.process.wait()
    assert all(p["parent"] != zygote_pid for p in processes(run_on_cpu(probe)))
    assert f"{warm.COLD_NOTE}the warm process died" in capsys.readouterr().err
    assert prepare_warm_launches(), "a new warm process should have been started"
    new_pid = warm._ZYGOTE.process.pid
    assert new_pid != zygote_pid and all(p["parent"] == new_pid for p in processes(run_on_cpu(probe)))


def test_torch_changed_on_disk_means_a_cold_launch_and_a_new_warm_process(probe, monkeypatch, capsys):
    assert prepare_warm_launches()
    old_pid = warm._ZYGOTE.process.pid
    monkeypatch.setattr(warm, "torch_fingerprint", lambda: "reinstalled")
    assert all(p["parent"] != old_pid for p in processes(run_on_cpu(probe)))
    assert "torch changed on disk" in capsys.readouterr().err
    monkeypatch.undo()
    assert prepare_warm_launches() and warm._ZYGOTE.process.pid != old_pid


PACKAGE_INSTALLED_LATER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.engines.local import warm
    from ddp_helpers.default_job import Hardware
    from ddp_helpers.default_job import prepare_warm_launches

    script, pth, package_folder = sys.argv[1:]
    run = lambda: launch(make_launch_config(script, nproc=2, backend="gloo", hardware=Hardware(()), stream=False))
    assert prepare_warm_launches()
    Path(pth).write_text(package_folder + "\\n")  # as `%pip install -e ./mylib` does
    first = run()
    assert first.ok, first.summary()
    assert [answer for answer, _ in first.facts("seen")] == [42, 42]
    assert prepare_warm_launches()
    again = run()  # the new warm process read the .pth file: warm again
    assert again.ok, again.summary()
    assert again.facts("seen") == [[42, warm._ZYGOTE.process.pid]] * 2, (again.facts("seen"), warm._ZYGOTE.process.pid)
    print("both runs saw the package")
    """
)


def test_a_package_installed_after_the_warm_process_started_is_importable(write_script, tmp_path):
    # A .pth file in site-packages naming the package's folder: only a process started after it reads it.
    # In an environment of its own (this project's packages reached through a .pth file), so that the other
    # test worker's warm process never sees site-packages change.
    import site
    import subprocess
    import sys
    import uuid

    environment = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
    private_site = next(environment.glob("lib/python*/site-packages"))
    (private_site / "project.pth").write_text(f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    name = f"mylib_{uuid.uuid4().hex[:8]}"
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / f"{name}.py").write_text("ANSWER = 42\n")
    script = write_script("uses_mylib", f"""
        import os
        import {name}
        from ddp_helpers import record
        record("seen", [{name}.ANSWER, os.getppid()])
    """)
    driver = write_script("driver", PACKAGE_INSTALLED_LATER)
    done = subprocess.run([str(environment / "bin" / "python"), str(driver), str(script),
                           str(private_site / f"__editable__{name}.pth"), str(tmp_path / "mylib")],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "both runs saw the package" in done.stdout
    assert "packages were installed or removed" in done.stderr


def test_two_sigterms_to_the_warm_process_leave_nothing_behind(write_script):
    # A kernel shut down with now=True sends SIGTERM twice. The second one arrives while the warm process
    # waits for a run's supervisor to stop: it must not cut the cleanup short.
    import signal
    import subprocess
    import threading
    import time

    assert prepare_warm_launches()
    process, folder = warm._ZYGOTE.process, warm._ZYGOTE.folder
    sleeper = write_script("sleeper", "import time\ntime.sleep(60)\n")
    thread = threading.Thread(target=run_on_cpu, args=(sleeper,), kwargs={"timeout_s": 90, "stream": False})
    thread.start()
    children = f"/proc/{process.pid}/task/{process.pid}/children"
    deadline = time.monotonic() + 30
    while len(open(children).read().split()) < 3 and time.monotonic() < deadline:  # supervisor and 2 ranks
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.005)  # the second one a moment later, as the kernel's shutdown sends it
    process.send_signal(signal.SIGTERM)
    # Its bound: SUPERVISOR_STOP_S for the supervisor, then it kills what is left and exits (seconds more
    # on a machine busy with other tests: 15 s in all was once not enough in the full suite).
    try:
        process.wait(timeout=SUPERVISOR_STOP_S + 20)
    except subprocess.TimeoutExpired:  # once in a full suite (2026-12-02): say where it was, for the next engineer
        where = subprocess.run(["py-spy", "dump", "--pid", str(process.pid)], capture_output=True, text=True,
                               timeout=30)
        with open(f"/proc/{process.pid}/status") as status:
            state = next(line for line in status if line.startswith("State"))
        process.kill()
        pytest.fail(f"the warm process did not exit within {SUPERVISOR_STOP_S + 20} s of two SIGTERMs ({state.strip()}; "
                    f"children {open(children).read().split()}):\n{where.stdout}{where.stderr}")
    thread.join(timeout=30)
    assert not os.path.exists(folder), os.listdir(folder)
    warm._ZYGOTE.stop()
    assert prepare_warm_launches()


RESTARTS = """
import os, signal, torch, torch.distributed as dist
from ddp_helpers import record
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
dist.barrier()
if attempt == 0 and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
dist.barrier()
record("attempt", attempt)
record("parent", os.getppid())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_torchrun_restarts_the_ranks_after_a_failure(write_script, cold):
    assert prepare_warm_launches()
    run = run_on_cpu(write_script("restarts", RESTARTS), max_restarts=1, cold=cold, timeout_s=90)
    assert run.ok, failure_report(run)
    assert run.facts("attempt") == [1, 1], "every rank runs again, once"
    assert all((parent == warm._ZYGOTE.process.pid) != cold for parent in run.facts("parent"))


DAEMON = DAEMON_SOURCE + """
import os
from ddp_helpers import record
record("rank", int(os.environ["RANK"]))
"""


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_a_daemon_a_rank_leaves_behind_is_swept(write_script, cold):
    import time

    from ddp_helpers.processes import process_is_dead

    assert prepare_warm_launches()
    run = run_on_cpu(write_script("daemon", DAEMON), cold=cold)
    assert run.ok, failure_report(run)
    daemons = [int((run.run_dir / f"daemon{rank}.pid").read_text()) for rank in (0, 1)]
    # It escaped into a new session with a new parent; the launch's sweep still finds it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(map(process_is_dead, daemons)):
        time.sleep(0.1)
    assert all(map(process_is_dead, daemons)), f"daemons of the run still alive: {daemons}"


def test_a_client_that_stalls_or_garbles_does_not_stall_the_warm_process(probe, zygote_pid):
    import socket

    if warm._ZYGOTE.process is None or warm._ZYGOTE.process.poll() is not None:
        assert prepare_warm_launches()
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(warm._ZYGOTE.socket_path)
    stalled.sendall(b"\x00\x00\x10\x00{")  # a length, then too little of the request
    garbled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbled.connect(warm._ZYGOTE.socket_path)
    garbled.sendall(b"\x00\x00\x00\x02{]")
    try:
        run = run_on_cpu(probe, timeout_s=60)
        zygote = warm._ZYGOTE.process.pid
        assert all(p["parent"] == zygote for p in processes(run)), "the launch after them is still warm"
    finally:
        stalled.close()
        garbled.close()


def test_a_variable_torch_sets_to_its_own_default_keeps_launches_warm():
    # The first optimizer step in a kernel writes TORCHINDUCTOR_CACHE_DIR (its default) into os.environ:
    # every later launch went cold for nothing. A different folder still means a cold launch.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from ddp_helpers.engines.local.warm_environment import environment_mismatch

    assert environment_mismatch({}, {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}) is None
    assert "TORCHINDUCTOR_CACHE_DIR" in environment_mismatch({}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere"})


def test_variables_native_code_reads_at_start_up_count_even_when_no_python_code_read_them():
    # The interpreter sets its locale from LC_*/LANG, oneDNN and glog read theirs in C: the warm process
    # cannot see those reads, so the families count whatever Python code was seen reading.
    from ddp_helpers.engines.local.warm_environment import environment_mismatch

    for name in ("LC_ALL", "LANG", "ONEDNN_VERBOSE", "GLOG_minloglevel", "OMP_NUM_THREADS"):
        assert name in (environment_mismatch({}, {name: "1"}, read=set()) or ""), name
    assert environment_mismatch({}, {"MY_SETTING": "1"}, read=set()) is None


STARTUP = """
import os, tempfile, time
import tqdm
from ddp_helpers import record
with open("/proc/self/status") as status:
    umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
record("seen", {"tmpdir": tempfile.gettempdir(), "timezone": time.timezone, "umask": umask,
                "tqdm_disabled": tqdm.tqdm(range(1)).disable, "custom": os.environ.get("MY_SETTING"),
                "parent": os.getppid()})
"""


def test_a_warm_rank_reads_its_environment_at_start_up_as_a_fresh_process(write_script, tmp_path, monkeypatch,
                                                                            capsys):
    """What a fresh process reads from its environment at start-up (TMPDIR in tempfile, TZ in time, TQDM_*
    in tqdm, anything a pre-imported library read at import) and inherits (the umask). A variable the warm
    process read as it imported its modules means a cold launch when a cell's --env sets it, and one cold
    launch and a new warm process when the kernel's own environment changes it; any other variable, a
    warm rank just finds in its environment."""
    script = write_script("startup", STARTUP)
    assert prepare_warm_launches()
    capsys.readouterr()
    plain = run_on_cpu(script, extra_env={"MY_SETTING": "1"})  # read by nothing at import: stays warm
    assert plain.ok, failure_report(plain)
    assert plain.facts("seen")[0]["custom"] == "1" and plain.facts("seen")[0]["parent"] == warm._ZYGOTE.process.pid
    (tmp_path / "tmp").mkdir()
    run = run_on_cpu(script, extra_env={"TMPDIR": str(tmp_path / "tmp")})  # warm or cold, tempfile sees it
    assert run.ok, failure_report(run)
    assert all(s["tmpdir"] == str(tmp_path / "tmp") for s in run.facts("seen"))
    # A variable the warm process saw read while it imported its modules: that cell launches cold.
    from ddp_helpers.engines.local.warm_environment import IMPORT_TIME_ENV_PREFIXES

    assert prepare_warm_launches()
    read = [name for name in warm._ZYGOTE.fingerprint["read_at_import"]
            if not name.startswith(IMPORT_TIME_ENV_PREFIXES) and name not in ("TMPDIR", "PATH", "HOME")]
    assert read, "the warm process noted the variables its imports read"
    capsys.readouterr()
    run = run_on_cpu(script, extra_env={read[0]: "set by this cell"})
    assert run.ok, failure_report(run)
    assert all(s["parent"] != warm._ZYGOTE.process.pid for s in run.facts("seen"))
    assert "(this launch's own --env or extra_env)" in capsys.readouterr().err
    old_umask = os.umask(0o027)
    try:
        monkeypatch.setenv("TZ", "UTC+05")
        monkeypatch.setenv("TQDM_DISABLE", "1")
        first = run_on_cpu(script)  # the kernel's environment changed: cold, and a new warm process
        assert first.ok, failure_report(first)
        assert "the warm process is started again" in capsys.readouterr().err
        assert prepare_warm_launches()
        second = run_on_cpu(script)
        assert second.ok, failure_report(second)
        for run in (first, second):
            assert all(s["timezone"] == 5 * 3600 and s["umask"] == 0o027 and s["tqdm_disabled"]
                       for s in run.facts("seen")), run.facts("seen")
        assert all(s["parent"] == warm._ZYGOTE.process.pid for s in second.facts("seen")), "warm again"
    finally:
        os.umask(old_umask)
        monkeypatch.undo()
        warm._ZYGOTE.stop()
        assert prepare_warm_launches()


def test_a_stopped_warm_process_is_noticed_and_replaced(write_script, capsys):
    # SIGSTOP before a launch: the launch runs cold at once and a new warm process replaces the stopped one.
    # SIGSTOP during a run: the run still ends when its ranks do (their exit codes from the run folder).
    import signal
    import threading
    import time

    script = write_script("short", """
        import os, time
        from ddp_helpers import record
        print("sleeping", flush=True)
        time.sleep(float(os.environ.get("SLEEP_S", "0")))
        record("parent", os.getppid())
    """)
    assert prepare_warm_launches()
    stopped = warm._ZYGOTE.process
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        capsys.readouterr()
        run = run_on_cpu(script, timeout_s=60)
        assert run.ok and run.wall_time_s < 45, failure_report(run)  # not held to its 60 s timeout
        assert "the warm process is stopped" in capsys.readouterr().err
        assert stopped.poll() is not None, "the stopped warm process is gone"
        assert prepare_warm_launches() and warm._ZYGOTE.process.pid != stopped.pid
        zygote = warm._ZYGOTE.process
        results = []
        script = write_script("short_again", script.read_text())  # a run folder no earlier run printed into
        thread = threading.Thread(target=lambda: results.append(
            run_on_cpu(script, timeout_s=60, stream=False, extra_env={"SLEEP_S": "3"})))
        thread.start()
        # Stop the warm process once both ranks run their script (forked, and told to start).
        folder = RunFolder(default_run_dir(script))
        deadline = time.monotonic() + 30
        while (not all("sleeping" in folder.read_text(folder.output(r, "stdout")) for r in (0, 1))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        os.kill(zygote.pid, signal.SIGSTOP)
        thread.join(timeout=60)
        run = results[0]
        assert run.ok and not run.timed_out, failure_report(run)
        assert run.facts("parent") == [zygote.pid] * 2
        assert "the warm process stopped answering during the run" in capsys.readouterr().err
    finally:
        for process in (stopped, warm._ZYGOTE.process):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
        warm._ZYGOTE.stop()
        assert prepare_warm_launches()


def test_preparing_warm_launches_replaces_a_warm_process_that_died():
    """What the tests' warm_launches fixture relies on: after an earlier test killed the warm process,
    preparing starts a new one instead of reporting it not ready."""
    from ddp_helpers.engines.local import warm
    from ddp_helpers.default_job import prepare_warm_launches

    assert prepare_warm_launches()
    dead = warm._ZYGOTE.process
    dead.kill()
    dead.wait()
    assert prepare_warm_launches(), "a dead warm process was not replaced"
    assert warm._ZYGOTE.process.pid != dead.pid


FRESH_KERNEL = textwrap.dedent(
    """
    import json, sys
    from IPython.testing.globalipapp import get_ipython
    from ddp_helpers.engines.local import warm

    shell = get_ipython()
    shell.run_line_magic("load_ext", "ddp_helpers")
    started_at_load = warm._ZYGOTE.process is not None
    # At once, as Run All does: the cell finds the warm process still starting. Its own --env sets a variable
    # no pre-imported module reads: it waits for the warm process all the same.
    shell.run_cell_magic("torchrun", "-n 2 --backend gloo --env FAIL_RANK=none --name first --out first", sys.argv[1])
    first = shell.user_ns["first"]
    print("RESULT " + json.dumps({"started_at_load": started_at_load, "ok": first.ok,
                                  "parents": first.facts("parent"), "zygote": warm._ZYGOTE.process.pid}))
    """
)


def test_load_ext_starts_the_warm_process_and_the_first_cell_waits_for_it(tmp_path):
    # (This one launch also shows a cell's --env of a variable nothing reads at import keeps the launch warm.)
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRESH_KERNEL, "import os\nfrom ddp_helpers import record\n"
                           "record('parent', os.getppid())\n"], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["started_at_load"], "%load_ext ddp_helpers should start the warm process"
    assert result["ok"] and result["parents"] == [result["zygote"]] * 2, result  # warm: forked from it
    assert "cold launch" not in done.stderr, done.stderr[-2000:]


def test_a_warm_process_started_from_a_thread_outlives_the_thread():
    # Linux's parent-death signal follows the thread that started a process, not the process: a launch in a
    # thread pool's thread must not leave a warm process that dies when that thread ends.
    import threading
    import time

    warm._ZYGOTE.stop()
    started = threading.Thread(target=prepare_warm_launches)
    started.start()
    started.join()
    zygote = warm._ZYGOTE.process
    time.sleep(1)  # the signal, had it been armed on the thread, arrives at once
    assert zygote.poll() is None, f"the warm process died with the thread that started it ({zygote.returncode})"
    assert prepare_warm_launches() and warm._ZYGOTE.process.pid == zygote.pid


KERNEL_WITH_THREADS = """
import os, sys
from pathlib import Path
from ddp_helpers import run_script
from ddp_helpers.engines.local import warm
from ddp_helpers.default_job import prepare_warm_launches
from ddp_helpers.default_job import Hardware

script = Path(sys.argv[1])
assert prepare_warm_launches(), "the warm process did not start"


def launch():
    run = run_script(script, nproc=2, backend="gloo", hardware=Hardware(()), stream=False, timeout_s=60)
    assert run.ok, run.summary()
    return [(fact["parent"] == warm._ZYGOTE.process.pid, fact["torch_threads"], fact["blas_ok"])
            for fact in run.facts("seen")]


print("FIRST", launch(), flush=True)
print("SECOND", launch(), flush=True)
os.environ["OMP_NUM_THREADS"] = "1"  # changed mid-session: one cold launch, then warm again
print("CHANGED", launch(), flush=True)
print("AFTER", launch(), flush=True)
"""


def test_threads_in_the_kernels_environment_keep_launches_warm(write_script, tmp_path):
    """OMP_NUM_THREADS >= 2 (common on clusters) makes OpenBLAS start threads as numpy loads: the warm process
    stops them before it serves, and forked ranks start their own pool again (the matmul below)."""
    import subprocess
    import sys

    probe = write_script("seen", """
        import os, numpy, torch
        from ddp_helpers import record
        a = numpy.ones((256, 256))
        record("seen", {"parent": os.getppid(), "torch_threads": torch.get_num_threads(),
                        "blas_ok": bool((a @ a)[0, 0] == 256)})
    """)
    kernel = tmp_path / "kernel.py"
    kernel.write_text(KERNEL_WITH_THREADS)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "DDP_HELPERS_RUNS": str(tmp_path / "runs")}
    done = subprocess.run([sys.executable, str(kernel), str(probe)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    # What a fresh process chooses under OMP_NUM_THREADS=2 (not always 2: 3 on 2 cores gave 2 here).
    fresh = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                               capture_output=True, text=True, check=True).stdout)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["FIRST"] == lines["SECOND"] == str([(True, fresh, True)] * 2), done.stdout + done.stderr
    assert lines["CHANGED"] == str([(False, 1, True)] * 2) and lines["AFTER"] == str([(True, 1, True)] * 2), \
        done.stdout + done.stderr
    assert done.stderr.count(warm.COLD_NOTE) == 1, done.stderr


@pytest.mark.parametrize("cold", [False, True])
def test_a_module_in_the_working_folder_is_not_importable_as_under_plain_torchrun(write_script, tmp_path, cold):
    """torchrun starts a worker as `python script.py`: the script's folder comes first on sys.path, and the working
    folder is not on it. The launcher's ranks start as `python -m ddp_helpers._bootstrap`, which puts the working
    folder there instead: a module lying in a --cwd (a data folder, a shared project folder) must not shadow what
    the script imports under plain torchrun."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "shadow_probe.py").write_text("FOUND = True\n")
    script = write_script("imports", """
        import os, sys
        from ddp_helpers import record
        try:
            import shadow_probe
            found = True
        except ImportError:
            found = False
        record("seen", {"found": found, "first": sys.path[0], "script_dir": os.path.dirname(os.path.abspath(__file__))})
    """)
    run = run_on_cpu(script, cwd=data, cold=cold)
    assert run.ok, failure_report(run)
    for seen in run.facts("seen"):
        assert seen == {"found": False, "first": seen["script_dir"], "script_dir": seen["script_dir"]}
