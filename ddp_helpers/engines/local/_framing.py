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
ROLES = ("supervisor", "worker")


class ForkRequest:
    """What a client asks the zygote to fork, as one message: a run's supervisor (from `warm`) or a rank
    (from `_zygote_stub`), with the environment, working directory, arguments and umask it would have had as
    a fresh process. (A plain class: the stub imports nothing it can do without, dataclasses included.)"""

    __slots__ = ("role", "argv", "env", "cwd", "umask")

    def __init__(self, role: str, argv: list[str], env: dict[str, str], cwd: str, umask: int):
        self.role, self.argv, self.env, self.cwd, self.umask = role, list(argv), dict(env), cwd, umask

    def to_message(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_message(cls, message: object) -> ForkRequest:
        """The request a message holds; ValueError if it is not one."""
        if not isinstance(message, dict) or set(message) != set(cls.__slots__) or message["role"] not in ROLES:
            raise ValueError("not a fork request")
        if not (isinstance(message["argv"], list) and all(isinstance(a, str) for a in message["argv"])
                and isinstance(message["env"], dict) and isinstance(message["cwd"], str)
                and isinstance(message["umask"], int)):
            raise ValueError("a fork request of the wrong shape")
        return cls(**message)


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
