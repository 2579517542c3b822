"""Real torchrun launches on gloo CPU ranks: what a run hands back, and how failures end."""

import re
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from ddp_helpers.errors import LaunchError
from ddp_helpers.launch_options import make_launch_config
from ddp_helpers.engines.local.engine import HANG_REPORT_WAIT_S, STACK_DUMP_WAIT_S, STOP_BOUND_S
from ddp_helpers.run_folder import RUN_ID_ENV
from support import (LOOPBACK_HEX, OWN_SOCKETS_SOURCE, failure_report, hold_port, printed_by_the_script, processes_left,
                     run_on_cpu)

LEAKED_FROM_AN_OUTER_TORCHRUN = {
    "RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "5", "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1",
    "TORCHELASTIC_RUN_ID": "outer",
}

HEALTHY_SCRIPT = OWN_SOCKETS_SOURCE + textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from ddp_helpers import record

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"line one from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    record("env", {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")})
    record("sum", total.item())
    record("weights", {"w": torch.full((3,), float(rank))})
    record("sockets", own_tcp_sockets())
    print(f"line two from rank {rank}")
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    """One 3-rank run shared by the tests of a healthy launch, started from an environment that looks
    like a kernel which itself runs under torchrun."""
    script = tmp_path_factory.mktemp("healthy") / "healthy.py"
    script.write_text(HEALTHY_SCRIPT)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LEAKED_FROM_AN_OUTER_TORCHRUN.items():
            patch.setenv(key, value)
        run = run_on_cpu(script, nproc=3)
    assert run.ok, failure_report(run)
    return run


def test_each_rank_output_is_kept_apart(healthy_run):
    for r in healthy_run.ranks:
        assert printed_by_the_script(r.stdout) == f"line one from rank {r.rank}\nline two from rank {r.rank}\n"
        assert f"warning from rank {r.rank}" in r.stderr
        assert r.exit_code == 0


def test_recorded_values_and_tensors_come_back_per_rank(healthy_run):
    assert healthy_run.facts("sum") == [3.0, 3.0, 3.0]
    for r in healthy_run.ranks:
        assert torch.equal(r.facts["weights"]["w"], torch.full((3,), float(r.rank)))
    with pytest.raises(KeyError, match="rank\\(s\\) \\[0, 1, 2\\]"):
        healthy_run.facts("never_recorded")


def test_a_kernel_running_under_torchrun_does_not_leak_its_world(healthy_run):
    for r in healthy_run.ranks:
        env = r.facts["env"]
        assert env["RANK"] == str(r.rank) and env["WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] != "10.9.9.9"
        assert env["TORCHELASTIC_RUN_ID"] != "outer"


def test_rank_sockets_stay_on_loopback(healthy_run):
    for r in healthy_run.ranks:
        sockets = r.facts["sockets"]
        assert sockets, "the rank should hold gloo connections while the group is up"
        off_loopback = [s for s in sockets if s["local"] not in LOOPBACK_HEX]
        assert not off_loopback, f"rank {r.rank} has sockets off loopback: {off_loopback}"


def test_run_reports_backend_devices_and_time(healthy_run):
    assert healthy_run.backend == "gloo"
    assert healthy_run.devices == ("cpu", "cpu", "cpu")
    assert 0 < healthy_run.wall_time_s < 120  # seconds, not minutes: however loaded the machine
    assert not (healthy_run.run_dir / "torchelastic").exists()


def test_output_streams_live_with_rank_prefixes(write_script, capfd):
    script = write_script("hello", "import os\nprint('hello from', os.environ['RANK'])\n")
    run = run_on_cpu(script, nproc=2)
    assert run.ok, failure_report(run)
    # Without the rank colours: they are on whenever ipykernel is loaded, as another test may have done.
    streamed = re.sub(r"\x1b\[[0-9;]*m", "", capfd.readouterr().out)
    assert "[rank 0] hello from 0" in streamed
    assert "[rank 1] hello from 1" in streamed


def test_a_failing_rank_is_named_with_its_traceback_and_the_others_stop(write_script):
    marker = uuid.uuid4().hex
    script = write_script(
        "fails",
        """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(0.5)
            raise ValueError("bad batch on rank 1")
        time.sleep(300)  # the other ranks would wait forever: torchrun must stop them
        """,
    )
    run = run_on_cpu(script, nproc=3, extra_env={"TEST_MARK": marker})
    assert not run.ok
    assert run.first_failure.rank == 1, failure_report(run)
    assert run.first_failure.error.type == "ValueError"
    assert 'raise ValueError("bad batch on rank 1")' in run.first_failure.error.traceback
    assert "_bootstrap" not in run.first_failure.error.traceback
    assert run.wall_time_s < 120  # stopped, not left sleeping 300 s
    assert [r.status for r in run.ranks] == ["stopped (SIGTERM)", "failed (exit code 1)", "stopped (SIGTERM)"]
    assert [r.exit_code for r in run.ranks] == [-15, 1, -15]
    assert "Rank 1 failed first, the root cause: ValueError: bad batch on rank 1" in run.summary()
    assert processes_left("TEST_MARK", marker) == []


def test_a_torch_function_raising_shows_torchs_frames_not_the_launchers_wrappers(write_script):
    """The launcher wraps all_reduce and send in each rank (to log what crossed): a traceback through them
    reads as plain torchrun's, the learner's line then torch's frames."""
    script = write_script(
        "raises_in_torch",
        """
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce([1.0])  # not a tensor
        else:
            dist.send(torch.ones(1), dst=1)  # to itself
        """,
    )
    run = run_on_cpu(script)
    for rank in run.ranks:
        traceback = rank.error.traceback if rank.error else rank.stderr
        assert "distributed_c10d.py" in traceback and "raises_in_torch.py" in traceback, failure_report(run)
        assert "_all_reduce_log" not in traceback and "_point_to_point" not in traceback, traceback
        assert "_all_reduce_log" not in rank.stderr and "_point_to_point" not in rank.stderr, rank.stderr


def test_a_hang_times_out_with_a_stack_dump_per_rank(write_script, capsys, warm_launches):
    # Warm (no --env): a cold start of two ranks importing torch can take most of the 8 s on a loaded machine.
    script = write_script(
        "hangs",
        """
        import time
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins this collective
        else:
            time.sleep(300)
        """,
    )
    capsys.readouterr()
    run = run_on_cpu(script, nproc=2, timeout_s=8)
    assert run.timed_out and not run.ok
    # What the learner sees: their own frames (the cell's line numbers) and the collective each waits in;
    # the zygote's, the bootstrap's and runpy's frames are folded, and every dump is still in stderr.
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)  # without the rank colours, if any
    assert '[rank 0]   File "hangs.py", line 7 in <module>' in shown, shown
    assert "[rank 0]   waiting in torch.distributed.all_reduce" in shown, shown
    assert '[rank 1]   File "hangs.py", line 9 in <module>' in shown, shown
    assert "frames of torch, Python and ddp_helpers folded" in shown
    assert "_bootstrap" not in shown and "runpy" not in shown and "c10d_logger" not in shown, shown
    # Ended at its timeout: then at most the hang report's and the stack dumps' waits, and the stop.
    assert run.wall_time_s < 8 + HANG_REPORT_WAIT_S + STACK_DUMP_WAIT_S + STOP_BOUND_S
    stuck_in = {0: "in all_reduce", 1: "hangs.py\", line 9"}
    for r in run.ranks:
        assert "most recent call first" in r.stderr, failure_report(run)
        assert stuck_in[r.rank] in r.stderr, failure_report(run)
    assert "Timed out after 8 s" in run.summary()
    assert run.run_id and processes_left(RUN_ID_ENV, run.run_id) == []


def test_eight_launches_at_once_while_port_29500_is_taken(write_script, warm_launches):
    script = write_script(
        "allreduce",
        """
        import torch, torch.distributed as dist
        from ddp_helpers import record
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        record("sum", t.item())
        dist.destroy_process_group()
        """,
    )
    try:
        blocker = hold_port(29500)
    except OSError:  # taken already (lesson 4 takes it on purpose in the browser test): as good for this test
        blocker = None
    runs = [None] * 8
    try:
        def launch_one(i):
            runs[i] = run_on_cpu(script, nproc=2, run_dir=script.parent / f"run{i}", stream=False, timeout_s=300)

        threads = [threading.Thread(target=launch_one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if blocker is not None:
            blocker.close()
    for run in runs:
        assert run.ok, failure_report(run)
        assert run.facts("sum") == [2.0, 2.0]


def test_a_script_that_records_also_runs_with_plain_python(write_script, tmp_path):
    script = write_script(
        "standalone",
        """
        from ddp_helpers import record
        value = record("answer", 42)
        print("recorded", value)
        """,
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "recorded 42\n"
    assert list(tmp_path.iterdir()) == [script]  # nothing written outside a launch


def test_a_missing_script_launches_nothing(tmp_path):
    with pytest.raises(LaunchError, match="Script not found"):
        make_launch_config(tmp_path / "missing.py", backend="gloo")
    assert list(tmp_path.iterdir()) == []


LISTENERS = OWN_SOCKETS_SOURCE + textwrap.dedent(
    """
    import os
    import torch.distributed as dist
    from ddp_helpers import record

    def listening(pid):
        return [s["local"] for s in own_tcp_sockets(pid) if s["state"] == "0A"]  # LISTEN

    dist.init_process_group("gloo")
    dist.barrier()  # every store and connection of the run is up
    record("listening", {"rank": listening(os.getpid()), "agent": listening(int(os.environ["DDP_HELPERS_AGENT_PID"]))})
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("options", [{}, {"max_restarts": 1}, {"nnodes": 2}], ids=["plain", "restarts", "2 agents"])
def test_nothing_of_a_run_listens_beyond_loopback(write_script, options):
    # The rendezvous store (hosted by the supervisor), the store the ranks share (hosted by the agent, or by
    # rank 0 when they do not share it) and gloo's own sockets: read from the socket table during the run.
    run = run_on_cpu(write_script("listeners", LISTENERS), cold=True, stream=False, **options)
    assert run.ok, failure_report(run)
    seen = {(r.rank, where): addresses for r in run.ranks for where, addresses in r.facts["listening"].items()}
    assert any(seen.values()), "the run's stores should be listening"
    assert all(a in LOOPBACK_HEX for addresses in seen.values() for a in addresses), seen


def test_a_script_that_empties_its_working_folder_leaves_the_run_folder_usable(write_script, tmp_path):
    """The run folder is the ranks' working folder by default; a script that cleans it removes the folder's marker
    too. The launcher puts it back, so the same run folder (a cell's name) launches again."""
    from support import run_on_cpu

    cleans = write_script("cleans", """
        import os, shutil
        if os.environ["RANK"] == "0":
            for entry in os.listdir("."):
                if entry.startswith(".ddp_helpers"):
                    os.remove(entry)
        """)
    run_dir = tmp_path / "run"
    for attempt in range(2):
        run = run_on_cpu(cleans, run_dir=run_dir)
        assert run.ok, failure_report(run)
