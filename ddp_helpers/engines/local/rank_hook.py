"""The local engine's rank hook (`rank_hooks`), named by the engine for each rank it starts:
- on this machine's runs, rank 0's job store listens on loopback only (`_keep_rank0_store_on_loopback`);
- the rank a demo kills (`--kill-rank`, `--kill-after`) SIGKILLs itself at the end of the line holding the text
  (`_KilledAfterPrinting`; the engine's `RankKiller` watches for it).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys

from ...rank_hooks import PatchOnImport
from ...run_folder import LOOPBACK_ENV, RunFolder


def start(folder: RunFolder, rank: int) -> None:
    if os.environ.get(LOOPBACK_ENV) == "1":  # every rank on this machine (not a cluster's)
        PatchOnImport.install({"torch.distributed.rendezvous": _keep_rank0_store_on_loopback})
    request = folder.read_kill_request()
    if request is not None and request.rank == rank and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        # Both text streams (logging writes to stderr); what bypasses them (sys.stdout.buffer, a subprocess) the
        # launcher sees in the output files a moment later (engine.RankKiller).
        sys.stdout = _KilledAfterPrinting(sys.stdout, request.text)
        sys.stderr = _KilledAfterPrinting(sys.stderr, request.text)


class _KilledAfterPrinting:
    """sys.stdout and sys.stderr of the rank a demo kills (`kill_rank`, `kill_after`): the rank SIGKILLs itself at the end
    of the line holding the text, as if the out-of-memory killer struck right then, so it does nothing
    more (see `engines.local.engine.RankKiller`)."""

    def __init__(self, stream, text: str):
        self._stream, self._text, self._tail = stream, text, ""

    def write(self, data: str) -> int:
        written = self._stream.write(data)
        self._tail = (self._tail + data)[-(len(self._text) + 4096):]
        found = self._tail.rfind(self._text)
        if found >= 0 and "\n" in self._tail[found + len(self._text):]:
            self._stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _keep_rank0_store_on_loopback(rendezvous) -> None:
    """When the ranks do not share their agent's store (restarts, several agents), rank 0 hosts the job's
    store (MASTER_ADDR:MASTER_PORT) with a plain TCPStore, which listens on every interface: on this
    machine's runs (MASTER_ADDR 127.0.0.1) it is handed a socket bound to loopback instead."""
    create = rendezvous._create_c10d_store

    @functools.wraps(create)
    def create_on_loopback(hostname, port, rank, world_size, timeout, use_libuv=True):
        if hostname != "127.0.0.1" or rank != 0 or rendezvous._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        with socket.create_server(("127.0.0.1", port), backlog=128) as listener:
            # The store takes over (and closes) the descriptor it is given: it gets a copy.
            return rendezvous.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                                       timeout=timeout, multi_tenant=True, use_libuv=use_libuv,
                                       master_listen_fd=os.dup(listener.fileno()))

    rendezvous._create_c10d_store = create_on_loopback
