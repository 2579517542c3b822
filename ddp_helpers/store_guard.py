"""Guards for torchrun's stores on a shared machine: every store a torchrun agent hosts listens on loopback
only, and the rendezvous state it unpickles must carry this job's signature.

Why both. A c10d `TCPStore` has no authentication, and binds every interface unless handed a socket already
bound. torchrun's c10d rendezvous keeps its state in the store as a pickle, and every agent reads it back with
`pickle.loads` (`torch/distributed/elastic/rendezvous/dynamic_rendezvous.py`, `_BackendRendezvousStateHolder.sync`),
during the rendezvous and then at every check of its monitor loop. Loopback keeps other machines out, but not
another user of this machine: any local process can connect to a loopback port and list the store's keys
(`TCPStore.list_keys`), so an unguessable run id is no defence either. So each state an agent writes is
prefixed with an HMAC under a key that only this job's agents hold (handed down in memory or in the
environment, which only the job's own user can read), and a state without it is refused before it is
unpickled: `RendezvousStateError`, the job fails, nothing of the stranger's bytes runs.

And a third: a rendezvous store this job's agents join on this machine must be hosted by this user. The port
is public (every agent's command line shows `--rdzv-endpoint`) while the agents import torch, and torch's c10d
backend quietly turns an agent that cannot bind the port into a client of whoever holds it
(`c10d_rendezvous_backend._create_tcp_store`): another user who binds it first would host the job's store, list
its keys and rewrite the unsigned ones. So a client store on one of this machine's addresses checks who listens
on its port (`/proc/net/tcp`, which shows each socket's owner) and refuses another user's: the agent meant to host
fails loudly instead (`refuse_other_users_stores`). An agent on another machine cannot see who listens there:
its job fails when the agent that was to host does (`srun --kill-on-bad-exit`), and the signature keeps the
stranger's state from being believed meanwhile.

Used by the launcher's supervisor (its agents are forked from it: they share the key) and by
`guarded_torchrun`, the real `torchrun` command as lessons 4 and 5 run it. No torch import at module level:
the patches import what they patch.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import ipaddress
import os
import socket

SIGNATURE_BYTES = hashlib.sha256().digest_size
LOOPBACK = "127.0.0.1"


def loopback_address(host: str) -> str:
    """The loopback address a store for `host` listens on: `host` itself when it is one (127.0.0.3 stands for
    a second machine in lesson 4's demos), else 127.0.0.1."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return LOOPBACK
    return address if ipaddress.ip_address(address).is_loopback else LOOPBACK


def loopback_store(port: int = 0, multi_tenant: bool = False, address: str = LOOPBACK, **options):
    """A TCPStore server on `address` (loopback; a port the OS picks, by default). A TCPStore binds every
    interface unless it is handed a socket already bound; it takes over (and closes) the descriptor it is
    given: it gets a copy. A port already taken raises torch's own `DistNetworkError` (EADDRINUSE)."""
    from torch.distributed import DistNetworkError, TCPStore

    try:
        listener = socket.create_server((address, port), backlog=128)
    except OSError as error:
        name = errno.errorcode.get(error.errno, str(error.errno))
        raise DistNetworkError(f"The server socket has failed to listen on {address}:{port} "
                               f"(errno: {error.errno} - {os.strerror(error.errno)}). [{name}]") from None
    with listener:
        return TCPStore(address, listener.getsockname()[1], is_master=True, multi_tenant=multi_tenant,
                        master_listen_fd=os.dup(listener.fileno()), **options)


# TCPStore's parameters after (host_name, port), in order: torch's callers pass some by position.
_STORE_PARAMETERS = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd",
                     "use_libuv")


def _store_factory(make_store):
    """`make_store` (torch's TCPStore) with its server side on loopback; clients are made as before."""

    @functools.wraps(make_store)
    def store(host_name, port, *positional, **options):
        options.update(zip(_STORE_PARAMETERS, positional))
        if not options.get("is_master") or options.get("master_listen_fd") is not None:
            return make_store(host_name, port, **options)
        options.pop("is_master")
        options.pop("master_listen_fd", None)
        return loopback_store(port, address=loopback_address(host_name), **options)

    store.on_loopback = True
    return store


def listening_owners(port: int, address: str) -> set[int]:
    """The user ids of the sockets listening on TCP `port` at `address` or at a wildcard (IPv4 and IPv6), from
    /proc/net/tcp and tcp6 (readable by every user, one line per socket with its owner's uid)."""
    wanted = {ipaddress.ip_address(address), ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    owners = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    local, state, uid = fields[1], fields[3], int(fields[7])
                    host, port_hex = local.split(":")
                    if state == "0A" and int(port_hex, 16) == port and _proc_net_address(host) in wanted:
                        owners.add(uid)
        except OSError:
            continue
    return owners


def _proc_net_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: host-order 32-bit words in hex; an IPv4-mapped IPv6 as IPv4."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    return address.ipv4_mapped or address if isinstance(address, ipaddress.IPv6Address) else address


def is_this_machines_address(host: str) -> bool:
    """Whether `host` names an address of this machine (one a socket here can bind)."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


class ForeignStoreError(RuntimeError):
    """The store at a rendezvous endpoint on this machine is held by another user's process."""


def check_store_is_ours(host: str, port: int) -> None:
    """ForeignStoreError if another user's process listens on `port` at `host` (an address of this machine)."""
    address = socket.gethostbyname(host)
    strangers = listening_owners(port, address) - {os.geteuid()}
    if strangers:
        raise ForeignStoreError(
            f"Port {port} on {host} is held by another user's process (uid {', '.join(map(str, sorted(strangers)))}), "
            "not by this job: the rendezvous store this agent would join is not this job's, and nothing was read "
            "from it. The agent meant to host the store could not, so the job stops here. Start it again (a new "
            "port: rendezvous_port), and tell the machine's administrator if it happens again.")


def _own_stores_only(make_store):
    """`make_store` (torch's TCPStore, or its loopback factory) whose client side, towards an address of this
    machine, refuses a store another user hosts."""
    if getattr(make_store, "own_stores_only", False):
        return make_store

    @functools.wraps(make_store)
    def store(host_name, port, *positional, **options):
        options.update(zip(_STORE_PARAMETERS, positional))
        made = make_store(host_name, port, **options)
        if not options.get("is_master") and is_this_machines_address(host_name):
            check_store_is_ours(host_name, port)
        return made

    store.own_stores_only = True
    return store


def refuse_other_users_stores() -> None:
    """In this process, an agent that joins a rendezvous store on this machine (c10d's, as a client after failing
    to host it, or the static rendezvous's) refuses one another user's process hosts: ForeignStoreError, which
    c10d reports as its RendezvousConnectionError."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    for module in (c10d_rendezvous_backend, static_tcp_rendezvous):
        module.TCPStore = _own_stores_only(module.TCPStore)


def keep_stores_on_loopback() -> None:
    """Every store a torchrun agent hosts, in this process, listens on loopback: the c10d rendezvous's
    (`c10d_rendezvous_backend._create_tcp_store`), the static rendezvous's, and the one the agent shares
    with its workers (`DynamicRendezvousHandler._create_tcp_store_server`)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    for module in (c10d_rendezvous_backend, static_tcp_rendezvous):
        if not getattr(module.TCPStore, "on_loopback", False):
            module.TCPStore = _store_factory(module.TCPStore)

    def create_on_loopback(self, master_addr, master_port):
        return loopback_store(master_port, multi_tenant=True, address=loopback_address(master_addr))

    DynamicRendezvousHandler._create_tcp_store_server = create_on_loopback


def sign_rendezvous_state(key: bytes) -> None:
    """In this process, every value the c10d rendezvous writes to its store carries an HMAC-SHA256 under
    `key` in front, and a value read back without the right one is refused (RendezvousStateError) before
    anything unpickles it. Done at the backend's one door to the store (`C10dRendezvousBackend._call_store`:
    "get" and "compare_set" of base64 text), so the backend's own logic (tokens, the empty-state sentinel)
    sees the values it wrote, unchanged."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    call_store = C10dRendezvousBackend._call_store
    if getattr(call_store, "signed", False):
        return

    def signed(value: str | bytes) -> bytes:
        value = value.encode() if isinstance(value, str) else value
        return hmac.new(key, value, hashlib.sha256).hexdigest().encode() + b"." + value

    def verified(stored: bytes) -> bytes:
        signature, _, value = bytes(stored).partition(b".")
        if not hmac.compare_digest(signature, signed(value).partition(b".")[0]):
            raise RendezvousStateError(
                "The rendezvous state in the store does not carry this job's signature: a process outside the "
                "job wrote it (a c10d store has no authentication: whoever reaches its port can write). It was "
                "refused unread.")
        return value

    @functools.wraps(call_store)
    def call_signed_store(self, store_op: str, *args):
        if store_op == "get":
            return verified(call_store(self, "get", *args))
        if store_op == "compare_set":  # (key, expected, desired); expected "" means "no value yet"
            store_key, expected, desired = args
            return verified(call_store(self, "compare_set", store_key, signed(expected) if expected else expected,
                                       signed(desired)))
        raise RuntimeError(f"the signed rendezvous backend does not know the store operation {store_op!r}")

    call_signed_store.signed = True
    C10dRendezvousBackend._call_store = call_signed_store
