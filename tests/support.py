"""Helpers shared by the tests: real launches, and looking for what a run may have left behind."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

from ddp_helpers import launch, make_launch_config
from ddp_helpers.default_job import Hardware
from ddp_helpers.rendezvous_port import rendezvous_port
from ddp_helpers.processes import marked_processes
from ddp_helpers.torch_compat import GLOO_CONNECTION_LINE


def course_notebooks() -> list[Path]:
    """The course the tests check: the notebooks as git's index holds them, exported by the root conftest.py
    (never the learner's working copies in notebooks/)."""
    return sorted(Path(os.environ["DDP_LESSONS_COURSE_UNDER_TEST"]).glob("*.ipynb"))


def course_notebook(name: str) -> Path:
    return Path(os.environ["DDP_LESSONS_COURSE_UNDER_TEST"]) / name


def exercise_cells(notebook: str, first_line_starts: str = "%%torchrun --name exercise") -> tuple[str, str, list[str]]:
    """A lesson's exercise, as the notebook gives it: (its %%torchrun line, the script below that line,
    the ```python blocks of the solution). Asserts the solution is hidden by default (<details>)."""
    import re

    import nbformat

    cells = nbformat.read(course_notebook(notebook), as_version=4).cells
    cell = next(c.source for c in cells if c.cell_type == "code" and c.source.startswith(first_line_starts))
    solution_cell = next(c.source for c in cells if c.cell_type == "markdown" and "Show the solution" in c.source)
    assert "<details>" in solution_cell, "the solution must be hidden by default"
    magic, script = cell.split("\n", 1)
    return magic, script, re.findall(r"```python\n(.*?)```", solution_cell, flags=re.S)


def run_on_cpu(script: Path, nproc: int = 2, **options):
    """Launch on gloo CPU ranks as a laptop would, whatever this machine has."""
    return launch(make_launch_config(script, nproc=nproc, backend="gloo", hardware=Hardware(()), **options))


def printed_by_the_script(text: str) -> str:
    """A rank's output without the line gloo prints as it connects under torch 2.10 and older
    (`torch_compat.GLOO_CONNECTION_LINE`): what the script itself printed."""
    return "".join(line for line in text.splitlines(keepends=True) if not GLOO_CONNECTION_LINE.match(line))


def failure_report(run) -> str:
    """Every rank's stderr and torchrun's log, for assertion messages."""
    parts = [run.summary()]
    for r in run.ranks:
        parts.append(f"--- rank {r.rank} stdout ---\n{r.stdout}\n--- rank {r.rank} stderr ---\n{r.stderr}")
    parts.append(f"--- torchrun ---\n{run.launcher_log}")
    return "\n".join(parts)


def processes_left(marker_env: str, value: str) -> list[int]:
    return marked_processes(value, marker_env)


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine (IPv4 and IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# Pasted into scripts: the local addresses (and states) of a process's own TCP sockets (this one's by
# default), from /proc.
OWN_SOCKETS_SOURCE = textwrap.dedent(
    '''
    import os as _os

    def own_tcp_sockets(pid="self"):
        inodes = set()
        for fd in _os.listdir(f"/proc/{pid}/fd"):
            try:
                target = _os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[9] in inodes:
                        local, port = fields[1].rsplit(":", 1)
                        found.append({"local": local, "port": int(port, 16), "state": fields[3]})
        return found
    '''
)

LOOPBACK_HEX = {
    "0100007F",  # 127.0.0.1
    "00000000000000000000000001000000",  # ::1
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
}


def hold_port(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen()
    return sock


# Pasted into rank scripts: leaves a daemon behind, the classic way (fork, new session, fork again: a new
# parent and a new session, so only the final sweep can find it), and returns once its pid is written to
# daemon<RANK>.pid in the working directory.
DAEMON_SOURCE = textwrap.dedent(
    '''
    import os as _os
    import time as _time

    _daemon_file = f"daemon{_os.environ['RANK']}.pid"
    if _os.fork() == 0:
        _os.setsid()
        if _os.fork() == 0:
            with open(_daemon_file + ".tmp", "w") as _f:
                _f.write(str(_os.getpid()))
            _os.replace(_daemon_file + ".tmp", _daemon_file)  # whole or absent, never half-written
            _time.sleep(300)
        _os._exit(0)
    while not _os.path.exists(_daemon_file):
        _time.sleep(0.02)
    '''
)


def free_port() -> int:
    """A port free on loopback now, below the range the OS hands out to other sockets, so that none of the
    suite's launches takes it first (for a command that must be given one, as a job script names one)."""
    return rendezvous_port("127.0.0.1")


# A wrong fix's side channel that the launcher does not watch: a raw TCP socket on loopback between the ranks (the
# port handed to every rank in SIDE_PORT, as a learner would hard-code one). `exchanged(value)` returns every rank's
# value, in rank order, on every rank; no collective, no file, no store.
SOCKET_EXCHANGE = '''
import json as _json, os as _os, socket as _socket, time as _time


def exchanged(value):
    port, me, world = int(_os.environ["SIDE_PORT"]), int(_os.environ["RANK"]), int(_os.environ["WORLD_SIZE"])
    if me == 0:
        listener = _socket.create_server(("127.0.0.1", port))
        values, connections = {0: value}, []
        for _ in range(world - 1):
            connection, _ = listener.accept()
            sender, sent = _json.loads(connection.makefile().readline())
            values[sender] = sent
            connections.append(connection)
        every = [values[r] for r in range(world)]
        for connection in connections:
            connection.sendall((_json.dumps(every) + "\\n").encode())
            connection.close()
        listener.close()
        return every
    while True:
        try:
            connection = _socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            _time.sleep(0.01)
    connection.sendall((_json.dumps([me, value]) + "\\n").encode())
    every = _json.loads(connection.makefile().readline())
    connection.close()
    return every
'''
