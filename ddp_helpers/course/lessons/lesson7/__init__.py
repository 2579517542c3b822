"""Lesson 7's reading of a run (build DDP yourself): the all-reduces torch's flight recorder saw, by process
group and by time window, and how far two sets of weights are apart. The scripts are the lesson's cells."""

from __future__ import annotations

import math

from ....flight_recorder import ALL_REDUCE_OPS


def all_reduces(collectives, group: str | None = None, window_ns: tuple[int, int] | None = None) -> list[dict]:
    """A rank's all-reduces (from `records.RankRecords.collectives`), of one process group ("world" for the default one,
    or a group's `group_desc`) and created within `window_ns` (the flight recorder's clock: time.time_ns())."""
    return [c for c in collectives if c["op"] in ALL_REDUCE_OPS and (group is None or c["group"] == group)
            and (window_ns is None or window_ns[0] <= c["started_ns"] <= window_ns[1])]


def values(call: dict) -> int:
    """The number of values a collective's tensors hold."""
    return sum(math.prod(shape) for shape in call["shapes"])


def largest_difference(weights, others) -> float:
    """The largest difference between two lists of tensors, element by element."""
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(weights, others, strict=True))

