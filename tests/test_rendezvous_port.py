"""A job's rendezvous port (`ddp_helpers.rendezvous_port`): below the ports the OS hands out by itself, so that
no connection or port-0 listener started meanwhile takes it, and free when drawn."""

import socket

from ddp_helpers.rendezvous_port import ephemeral_low, rendezvous_port


def test_the_port_is_below_the_os_range_and_binds():
    low = ephemeral_low()
    for _ in range(20):
        port = rendezvous_port("127.0.0.1")
        assert 1024 <= port < low
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_given(monkeypatch):
    import random

    draw = random.randrange
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        drawn = iter([taken, taken])  # the first two draws hit the port in use, then random again
        monkeypatch.setattr(random, "randrange", lambda start, stop: next(drawn, None) or draw(start, stop))
        assert rendezvous_port("127.0.0.1") != taken
