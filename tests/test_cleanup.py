"""Stopping the launching process mid-run leaves no worker and no listening port behind.

The launcher runs in a child Python process, as it does in a Jupyter kernel: SIGINT is what the
notebook's stop button sends; SIGKILL is how Jupyter ends a kernel that is restarted or shut down.
"""

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from support import listening_ports, processes_left

LAUNCHING_PROCESS = textwrap.dedent(
    """
    import sys
    from ddp_helpers import launch, make_launch_config
    from ddp_helpers.config import Hardware
    config = make_launch_config(sys.argv[1], nproc=2, backend="gloo", hardware=Hardware(()),
                                extra_env={"TEST_MARK": sys.argv[2]})
    try:
        launch(config)
    except KeyboardInterrupt:
        print("launcher saw KeyboardInterrupt", flush=True)
        sys.exit(130)
    """
)

SLOW_WORKER = textwrap.dedent(
    """
    import os, time
    import torch.distributed as dist
    from ddp_helpers import record
    dist.init_process_group("gloo")
    dist.barrier()
    record("store_port", int(os.environ["MASTER_PORT"]))
    time.sleep(300)
    """
)


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["KeyboardInterrupt", "SIGKILL"])
def test_stopping_the_launcher_leaves_nothing_behind(tmp_path, how):
    marker = uuid.uuid4().hex
    worker = tmp_path / "slow.py"
    worker.write_text(SLOW_WORKER)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING_PROCESS, str(worker), marker],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        port_file = tmp_path / "slow" / "facts" / "rank1" / "store_port.json"
        wait_until(port_file.exists, 60, "both ranks joined the group")
        port = json.loads(port_file.read_text())
        assert port in listening_ports(), "the rendezvous store should listen while the run is up"
        assert len(processes_left("TEST_MARK", marker)) >= 3  # torchrun and two workers

        launcher.send_signal(how)
        output, _ = launcher.communicate(timeout=30)
        if how == signal.SIGINT:
            assert "launcher saw KeyboardInterrupt" in output
        wait_until(lambda: not processes_left("TEST_MARK", marker), 10, "every process of the run is gone")
        wait_until(lambda: port not in listening_ports(), 10, f"port {port} is closed")
    finally:
        launcher.kill()
        launcher.wait()
