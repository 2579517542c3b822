"""What torchrun's agent waits for that does no work on one machine, taken out of the supervisor's agents
(`agents.run_agent`), measured by `benchmarks/launch_phases.py`. Each change keeps what the agent does and
in what order; only idle time goes. The real torchrun of lessons 4-5 (`guarded_torchrun`) is untouched.

Read in torch's source (the same in 2.4 to 2.13):
- `elastic/rendezvous/dynamic_rendezvous.py`: before an agent first joins, a random 0-0.3 s sleep
  (`_delay(seconds=(0, 0.3))`); and each event the rendezvous records is named after its caller with two
  `inspect.stack()` calls (`get_method_name`), which look up every frame's module and source line (loading
  its whole file through linecache): 10-30 ms an event, a dozen events a launch, even when nothing records them (the default NullHandler drops them).
- `elastic/agent/server/api.py`, `_invoke_run`: the agent looks at its workers every `monitor_interval`
  (`time.sleep(monitor_interval)`): on average half an interval passes between the last worker's exit
  and the agent noticing it.
"""

from __future__ import annotations

import os
import select
import sys
import time


def without_idle_waits() -> None:
    """In this process (an agent of the supervisor's), all three idle waits below go."""
    skip_first_join_skew()
    name_rendezvous_events_from_the_frame()
    wake_the_monitor_when_a_worker_exits()


def skip_first_join_skew() -> None:
    """torchrun's c10d rendezvous no longer sleeps its random 0 to 0.3 s before an agent first joins
    (`DynamicRendezvousHandler.next_rendezvous`: `_delay(seconds=(0, 0.3))`, "to slightly skew the
    rendezvous attempts across the nodes and reduce the load on the backend"). The agents here are on this
    machine and meet on a store of their own: the skew spreads nothing and adds 150 ms to a launch on
    average. Only that random delay goes; a waiting agent still polls once a second (`_delay(seconds=1)`),
    and the rendezvous numbers the agents as before (sorted, whatever their order of arrival)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous._delay
    if hasattr(original, "__wrapped__"):
        return

    def delay(seconds):
        if not isinstance(seconds, tuple):  # a random skew is given as its bounds
            original(seconds)

    delay.__wrapped__ = original
    dynamic_rendezvous._delay = delay


def method_name_from_the_frame(depth: int = 2) -> str:
    """What the rendezvous's `get_method_name(depth)` returns (the name of the function `depth` frames up, or
    "no_method_name"), read from the frame, not from `inspect.stack()`."""
    try:
        return sys._getframe(depth).f_code.co_name  # frame 0 is this one, as inspect.stack()[0] was
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def name_rendezvous_events_from_the_frame() -> None:
    """The rendezvous names its events with `method_name_from_the_frame`: the same names, without
    `inspect.stack()` looking up the module and source line of every frame of the stack, twice an event:
    ~100 ms of a launch's rendezvous and close."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.get_method_name
    if original is method_name_from_the_frame:
        return
    method_name_from_the_frame.__wrapped__ = original
    dynamic_rendezvous.get_method_name = method_name_from_the_frame


class _WorkerExits:
    """The agent's workers, each as a pidfd (readable once the process has exited, reaped or not): the
    monitor's sleep ends when one of them exits, and the process is left for the agent to reap, as before."""

    def __init__(self):
        self._pidfds: list[int] = []

    def watch(self, pids) -> None:
        """The workers just started (after a restart, the old ones are no longer watched)."""
        self._forget()
        for pid in pids:
            try:
                self._pidfds.append(os.pidfd_open(pid))
            except (AttributeError, OSError):  # already reaped (the agent saw it end), or no pidfds in this
                # Python (built without them, as some conda builds are) or kernel: the sleep is plain
                pass

    def _forget(self) -> None:
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = []

    def sleep(self, seconds: float) -> None:
        """The monitor's `time.sleep(monitor_interval)`: it ends early when a worker exits (the agent then
        looks at once), else after `seconds` as before."""
        if not self._pidfds:
            time.sleep(seconds)
            return
        ended, _, _ = select.select(self._pidfds, [], [], seconds)
        for fd in ended:  # seen once: an exited worker's pidfd stays readable
            self._pidfds.remove(fd)
            os.close(fd)


class _TimeWithMonitorSleep:
    """The `time` module as the agent's `api.py` sees it: `sleep` is `_WorkerExits.sleep` (its one use there
    is the monitor's), everything else is `time`'s own."""

    def __init__(self, exits: _WorkerExits):
        self.sleep = exits.sleep

    def __getattr__(self, name):
        return getattr(time, name)


def wake_the_monitor_when_a_worker_exits() -> None:
    """The agent's monitor (`SimpleElasticAgent._invoke_run`) still looks at its workers every
    `--monitor-interval`, and now also as soon as one of them exits: a run ends, or a failed rank's peers
    are stopped, without waiting for the rest of the interval (on average 50 ms at our 0.1 s)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if isinstance(api.time, _TimeWithMonitorSleep):
        return
    exits = _WorkerExits()
    api.time = _TimeWithMonitorSleep(exits)
    start_workers = LocalElasticAgent._start_workers

    def start_and_watch_workers(self, worker_group):
        pids = start_workers(self, worker_group)
        exits.watch(pids.values())
        return pids

    LocalElasticAgent._start_workers = start_and_watch_workers
