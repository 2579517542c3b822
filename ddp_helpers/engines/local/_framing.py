"""Length-prefixed JSON messages over a Unix socket: the warm-launch protocol between `warm` (the
kernel's client), `zygote` (the server) and `_zygote_stub` (torchrun's worker stand-in).

Each message is a 4-byte big-endian length, then that many bytes of JSON. Standard library only:
`_zygote_stub` runs with `python -S` and imports this file by its own folder, not as part of the package.
"""

from __future__ import annotations

import json
import socket
import struct

_HEADER = struct.Struct("!I")


def encode(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send one message, with file descriptors passed alongside (SCM_RIGHTS) when `fds` are given."""
    if fds:
        socket.send_fds(sock, [encode(message)], list(fds))
    else:
        sock.sendall(encode(message))


def receive(sock: socket.socket, already: bytes = b"") -> dict | None:
    """The next message (`already`: bytes of it read before, e.g. with its descriptors); None if the peer
    closed the connection before the message was whole."""
    data = already
    for size in (_HEADER.size, None):
        wanted = _HEADER.size if size is not None else _HEADER.size + _HEADER.unpack(data[:_HEADER.size])[0]
        while len(data) < wanted:
            chunk = sock.recv(wanted - len(data))
            if not chunk:
                return None
            data += chunk
    return json.loads(data[_HEADER.size:])
