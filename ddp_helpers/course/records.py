"""The course's records of each rank: what its rank hook (`evidence_hook`) saw a rank's script do, kept in the run
folder beside the launcher's own files, and read back here for the exercise checkers and the lessons' evidence
(`records(run)[rank]`). A launch without the course's hook (a plain `%load_ext ddp_helpers`) has none: every field
is then empty.

    rankN.writes.json            the files its script wrote (an audit hook saw them)
    rankN.crossings              other ranks' files in the run folder its script opened or changed, or its own
                                 secret changed, one line each as it happened (`note_crossing`)
    rankN.p2p.json               its send/recv calls
    rankN.all_reduced.json       what its script handed to all_reduce and to the collectives that move its data
    rankN.collectives.json       its collectives, as torch's flight recorder held them at the end
    rankN.channel_bytes.json     what its store and point-to-point calls moved
    rankN.held.json              what its tensors held after each optimizer step (`_held_memory`; lesson 3)
    rankN.activations.json       what autograd held for backward, at each change (`_held_activations`; lesson 1)
    rankN.secret                 a number only rank N's process is handed, drawn at its first attempt: an
                                 exercise's data comes from it (`ddp_helpers.rank_secret`), and its checker reads it

Rank side: nothing here imports torch.
"""

from __future__ import annotations

import json
import secrets as random_bits
import weakref
from dataclasses import dataclass, field

from ..run_folder import RunFolder, append_line, register_rank_records

_WRITES, _P2P, _ALL_REDUCED, _COLLECTIVES, _CHANNEL_BYTES, _HELD, _ACTIVATIONS = (
    "writes.json", "p2p.json", "all_reduced.json", "collectives.json", "channel_bytes.json", "held.json",
    "activations.json")
_CROSSINGS, _SECRET = "crossings", "secret"
register_rank_records(_WRITES, _P2P, _ALL_REDUCED, _COLLECTIVES, _CHANNEL_BYTES, _HELD, _ACTIVATIONS, _CROSSINGS,
                      _SECRET)


@dataclass(frozen=True)
class RankRecords:
    """What the course's rank hook saw one rank's script do.

    Attributes:
        rank: the global rank.
        files_written: absolute paths of the files the rank's script opened for writing or renamed into place
            (seen, not reported by the script); empty if the rank did not end normally.
        point_to_point: its `send`/`recv`/`isend`/`irecv` calls, in order: {"op", "peer", "shape", "dtype",
            "number", "values" (small tensors only), "batch" (in a `batch_isend_irecv`)}, and its backwards
            ({"op": "backward", "received_used"}: `_point_to_point`); empty if the rank did not end normally.
        all_reduced: its script's own `all_reduce` calls, in order (the first 1000): {"shape", "dtype", "op",
            "values" (what it put in; tensors of at most 64 elements)}; DDP's all-reduces, made in C++, are not
            among them.
        handed_to_collectives: what its script put into each collective that moves its data (all_reduce,
            all_gather, reduce, gather, broadcast, reduce_scatter, their object forms): {"collective", "values",
            ...}; the evidence exercise checkers ask for.
        collectives: the collectives its script called, in order, as torch's flight recorder held them at the end
            (its last 2000): {"number" (in its group), "op", "shapes", "dtypes", "group", "started_ns"}.
        channel_bytes: what its script moved where the flight recorder does not look: {"sent_bytes",
            "received_bytes"} of point-to-point calls, {"store_calls", "store_bytes"} of key-value store calls.
        held_after_steps: after each optimizer step its script made (once something asked for the measurement:
            lesson 3's `my_batch`), the bytes its tensors held: {"parameters", "gradients", "optimizer_state",
            "other"} (`_held_memory`); empty if not measured or the rank did not end normally.
        held_for_backward: the bytes autograd held for backward, at each change, with the point-to-point calls
            made by then: [calls, bytes] (`_held_activations`, once something asked for it: lesson 1's
            `my_inputs`); empty if not measured or the rank did not end normally.
        crossings: what its script did to other ranks' files in the run folder (their secrets, outputs, facts), or
            to its own secret: "opened", "changed", "linked to"... and the file's name there. Kept however the
            rank ended.
        secret: the number only its process was handed (None: the course's hook was off, or it never started).
    """

    rank: int
    files_written: tuple[str, ...] = ()
    point_to_point: tuple[dict, ...] = ()
    all_reduced: tuple[dict, ...] = ()
    handed_to_collectives: tuple[dict, ...] = ()
    collectives: tuple[dict, ...] = ()
    channel_bytes: dict = field(default_factory=dict)
    held_after_steps: tuple[dict, ...] = ()
    held_for_backward: tuple[list, ...] = ()
    crossings: tuple[str, ...] = ()
    secret: int | None = None


# ---- written in the ranks (by `evidence_hook`) --------------------------------------------------------------

def draw_secret(folder: RunFolder, rank: int) -> int:
    """The rank's secret for this launch: drawn at its first attempt, the same after a restart."""
    kept = read_secret(folder, rank)
    if kept is not None:
        return kept
    drawn = random_bits.randbits(62)
    folder.write_json(folder.rank_record(rank, _SECRET), {"rank": rank, "secret": drawn})
    return drawn


def is_secret(name: str) -> bool:
    """Whether `name` (a rank's file, as `RunFolder.rank_file_owner` names it) is a rank's secret."""
    return name.endswith(f".{_SECRET}") and name.startswith("rank") and name[4:-len(_SECRET) - 1].isdigit()


def note_crossing(folder: RunFolder, rank: int, name: str, how: str) -> None:
    """Rank `rank`'s script `how` ("opened", "changed", "linked to"...) the file `name` of the run folder: one line
    appended at once (a rank that then ends with os._exit, or a forked child, keeps it)."""
    append_line(folder.rank_record(rank, _CROSSINGS), json.dumps({"run_id": folder.run_id, "what": f"{how} {name}"}))


def write(folder: RunFolder, rank: int, *, files_written, point_to_point, all_reduced, collectives,
          channel_bytes: dict, held_after_steps=(), held_for_backward=()) -> None:
    """What the rank's script did, written as it ended."""
    folder.write_json(folder.rank_record(rank, _WRITES), {"rank": rank, "files": sorted(files_written)})
    folder.write_json(folder.rank_record(rank, _P2P), {"rank": rank, "calls": list(point_to_point)})
    folder.write_json(folder.rank_record(rank, _ALL_REDUCED), {"rank": rank, "calls": list(all_reduced)})
    folder.write_json(folder.rank_record(rank, _COLLECTIVES), {"rank": rank, "calls": list(collectives)})
    folder.write_json(folder.rank_record(rank, _CHANNEL_BYTES), {"rank": rank, "totals": dict(channel_bytes)})
    folder.write_json(folder.rank_record(rank, _HELD), {"rank": rank, "calls": list(held_after_steps)})
    folder.write_json(folder.rank_record(rank, _ACTIVATIONS), {"rank": rank, "calls": list(held_for_backward)})


# ---- read back (checkers, lessons) ----------------------------------------------------------------------------

def read_secret(folder: RunFolder, rank: int) -> int | None:
    """The rank's secret in the launch `folder.run_id` (None: none drawn, another launch's, or not one)."""
    secret = (folder.read_own_json(folder.rank_record(rank, _SECRET)) or {}).get("secret")
    return secret if isinstance(secret, int) and not isinstance(secret, bool) else None


def read_crossings(folder: RunFolder, rank: int) -> tuple[str, ...]:
    """What `note_crossing` noted for `rank` in this launch, in order, each once."""
    seen = []
    for line in folder.read_text(folder.rank_record(rank, _CROSSINGS)).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("run_id") == folder.run_id and entry.get("what") not in seen:
            seen.append(str(entry.get("what")))
    return tuple(seen)


def read(folder: RunFolder, rank: int) -> RankRecords:
    """One rank's records of the launch `folder.run_id` (another launch's files are left out)."""
    def calls(kind: str, key: str = "calls") -> tuple:
        return tuple((folder.read_own_json(folder.rank_record(rank, kind)) or {}).get(key, ()))

    handed = calls(_ALL_REDUCED)
    return RankRecords(
        rank=rank, files_written=calls(_WRITES, "files"), point_to_point=calls(_P2P),
        all_reduced=tuple(call for call in handed if "collective" not in call),
        handed_to_collectives=tuple({"collective": "all_reduce", **call} if "collective" not in call else call
                                    for call in handed),
        collectives=calls(_COLLECTIVES), held_after_steps=calls(_HELD), held_for_backward=calls(_ACTIVATIONS),
        crossings=read_crossings(folder, rank), secret=read_secret(folder, rank),
        channel_bytes=dict((folder.read_own_json(folder.rank_record(rank, _CHANNEL_BYTES)) or {}).get("totals", {})))


# Each run's records as read when it ended, kept as long as the run (its RunResult) is: by id, with a weak reference
# that tells a reused id from the run it was read for.
_READ: dict[int, tuple[weakref.ref, tuple[RankRecords, ...]]] = {}


def read_run(run, folder: RunFolder | None = None) -> None:
    """Read every rank's records of a finished run (a `RunResult`) for `records`: the launcher calls it as each
    launch is read back (`readback.read_also`, which `keep_records` asks for), while the run folder is that launch's."""
    folder = folder if folder is not None else RunFolder(run.run_dir, run.run_id)
    key = id(run)
    _READ[key] = (weakref.ref(run, lambda _, key=key: _READ.pop(key, None)),
                  tuple(read(folder, rank.rank) for rank in run.ranks))


def records(run) -> tuple[RankRecords, ...]:
    """Every rank's records of a finished run (a `RunResult`), indexed by rank: `records(run)[1].files_written`.
    As read when the run ended (a later launch into the same folder does not change them). A run read back before
    the course was loaded is read now: what its folder still holds of that launch (records of a later launch there
    are never taken for its own)."""
    kept = _READ.get(id(run))
    if kept is None or kept[0]() is not run:
        read_run(run)
        kept = _READ[id(run)]
    return kept[1]
