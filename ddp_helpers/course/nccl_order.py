"""Would a run's point-to-point calls, in the order each rank made them, also finish on GPUs?

A run here uses gloo, where `isend`/`irecv` let the host go on while the message waits for its partner. On nccl the
host goes on too, but the GPU does not: each point-to-point call outside a `dist.batch_isend_irecv` becomes one NCCL
operation, queued on the stream the two ranks' calls share, and it completes only once the other rank's matching
call runs; the calls of one batch are one NCCL group and progress together. So two ranks that each send before
they receive can finish on gloo with `isend` and still hang on GPUs. torch's own pipeline schedules post a stage's
send and its next receive together for that reason (`torch/distributed/pipelining/schedules.py`, `_batch_p2p`:
"Mixed batches still use batch_isend_irecv for deadlock avoidance"; `Schedule1F1B`: "we need to fire the fwd_sends
and bwd_recvs together"). NCCL's documentation says the same of its own calls: those that must progress at the
same time go into one group.

`stuck_on_nccl` replays the ranks' logged calls (`records(run)[rank].point_to_point`) under that rule. Messages
between two ranks in one direction match in the order they were called, as on both backends.
"""

from __future__ import annotations

SENDS, RECEIVES = ("send", "isend"), ("recv", "irecv")


def _groups(calls: list[dict]) -> list[list[dict]]:
    """A rank's point-to-point calls as the GPU runs them: one batch_isend_irecv's calls together, any other alone."""
    groups: list[list[dict]] = []
    for call in calls:
        if call.get("op") not in SENDS + RECEIVES:
            continue
        batch = call.get("batch")
        if batch is not None and groups and groups[-1][0].get("batch") == batch:
            groups[-1].append(call)
        else:
            groups.append([call])
    return groups


def stuck_on_nccl(calls_by_rank: list[list[dict]]) -> dict[int, dict] | None:
    """None if every rank's calls complete when run as nccl runs them; otherwise, for each rank that would wait
    forever, the call it would wait in (the first of its group not completed)."""
    ranks = range(len(calls_by_rank))
    groups = [_groups(calls) for calls in calls_by_rank]
    # Each call's partner: the n-th send from a to b matches the n-th receive on b from a (a receive from any
    # source, peer None, is taken as from the one other rank when there are two).
    key_of = {}
    for rank in ranks:
        counts: dict[tuple, int] = {}
        for group in groups[rank]:
            for call in group:
                peer = call.get("peer")
                if peer is None and len(calls_by_rank) == 2:
                    peer = 1 - rank
                pair = (rank, peer) if call["op"] in SENDS else (peer, rank)
                direction = "send" if call["op"] in SENDS else "recv"
                counts[(pair, direction)] = counts.get((pair, direction), -1) + 1
                key_of[id(call)] = (pair, counts[(pair, direction)], direction)
    done: set[int] = set()
    position = [0 for _ in ranks]
    progressed = True
    while progressed:
        progressed = False
        running = {}  # (pair, n, direction) of every call on a GPU now, to its call
        for rank in ranks:
            if position[rank] < len(groups[rank]):
                for call in groups[rank][position[rank]]:
                    if id(call) not in done:
                        running[key_of[id(call)]] = call
        for (pair, number, direction), call in list(running.items()):
            partner = running.get((pair, number, "recv" if direction == "send" else "send"))
            if partner is not None and id(call) not in done:
                done.update((id(call), id(partner)))
                progressed = True
        for rank in ranks:
            while position[rank] < len(groups[rank]) and all(id(c) in done for c in groups[rank][position[rank]]):
                position[rank] += 1
                progressed = True
    stuck = {rank: next(c for c in groups[rank][position[rank]] if id(c) not in done)
             for rank in ranks if position[rank] < len(groups[rank])}
    return stuck or None
