"""A port for a job's rendezvous store that nothing takes before torchrun binds it:

    port=$(python -m ddp_helpers.rendezvous_port)

A port the OS picks (bind to port 0, read it, close) comes from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), from which every outgoing connection and every port-0 listener
started meanwhile also draws: on a busy machine one of them can take it before the store binds it, and the
job fails. This picks a random port below that range instead, one that binds now. Stdlib only (job scripts
run it before anything else).
"""

from __future__ import annotations

import random
import socket

_SPAN = 10_000  # ports below the ephemeral range drawn from
_TRIES = 200


def ephemeral_low(default: int = 32768) -> int:
    """The first port of the range the OS hands out by itself."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def rendezvous_port(host: str = "") -> int:
    """A random port below the OS's ephemeral range that binds on `host` now ("" : every address)."""
    low = ephemeral_low()
    for _ in range(_TRIES):
        port = random.randrange(max(1024, low - _SPAN), low)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port found below {low} after {_TRIES} tries")


if __name__ == "__main__":
    print(rendezvous_port())
