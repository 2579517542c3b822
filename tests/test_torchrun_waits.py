"""The idle waits taken out of the supervisor's torchrun agents (`engines/local/torchrun_waits.py`) and out of
a rank's end (`_bootstrap`): each keeps what torch would have done, only sooner."""

import subprocess
import sys
import time
import weakref

import torch.library
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from ddp_helpers import _bootstrap
from ddp_helpers.engines.local import torchrun_waits


def _torchs_get_method_name():
    original = dynamic_rendezvous.get_method_name
    return getattr(original, "__wrapped__", original)


def test_rendezvous_events_keep_the_names_torch_gives_them():
    torchs = _torchs_get_method_name()

    def recorded_by():  # as `_record` calls it: the name of its caller
        return torchs(), torchrun_waits.method_name_from_the_frame()

    def next_rendezvous():
        return recorded_by()

    assert next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    assert torchs(depth=1) == torchrun_waits.method_name_from_the_frame(depth=1) == \
        "test_rendezvous_events_keep_the_names_torch_gives_them"
    assert torchs(depth=10_000) == torchrun_waits.method_name_from_the_frame(depth=10_000) == "no_method_name"


def test_the_monitor_wakes_when_a_worker_exits_and_leaves_it_to_the_agent_to_reap():
    exits = torchrun_waits._WorkerExits()
    worker = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])
    try:
        exits.watch([worker.pid])
        started = time.monotonic()
        exits.sleep(60)
        assert time.monotonic() - started < 30, "the monitor slept its whole interval after the worker exited"
        assert worker.poll() == 3  # not reaped by the watch: the agent reads the real exit code
        started = time.monotonic()
        exits.sleep(0.2)  # an exit is seen once: the next sleep is a whole interval, not a spin
        assert time.monotonic() - started >= 0.2
    finally:
        worker.kill()
        worker.wait()


def test_a_reaped_worker_or_none_leaves_a_plain_sleep():
    exits = torchrun_waits._WorkerExits()
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    worker.wait()
    exits.watch([worker.pid])  # gone already
    started = time.monotonic()
    exits.sleep(0.2)
    assert time.monotonic() - started >= 0.2


def test_at_a_ranks_end_torchs_operator_libraries_are_left_alone_and_nothing_else():
    library = torch.library.Library("ddp_lessons_test", "DEF")  # alive: finalised at exit, as torch's own are

    class Kept:
        pass

    kept = Kept()
    own = weakref.finalize(kept, print, "the script's own")
    _bootstrap._skip_torch_library_teardown()
    registry = weakref.finalize._registry
    libraries = [info for info in registry.values() if info.func is torch.library._del_library]
    assert libraries and not any(info.atexit for info in libraries)
    assert not next(f for f in registry if f.peek() and f.peek()[0] is library).atexit
    assert own.atexit
    own.detach()


def test_a_python_without_pidfds_sleeps_plainly(monkeypatch):
    monkeypatch.delattr("os.pidfd_open")  # CPython built without them (some conda builds)
    exits = torchrun_waits._WorkerExits()
    exits.watch([1])
    started = time.monotonic()
    exits.sleep(0.2)
    assert time.monotonic() - started >= 0.2
