"""The hang report of a timed-out run: one table of what each rank waits in, and one sentence naming the
cause where it can be seen ("rank 1 never called all_reduce #7, which rank 0 is waiting in").

Read from the ranks themselves (`_hang_probe` writes each rank's answer from torch's flight recorder and
the bootstrap's point-to-point log), from their stack dumps (the line of the learner's code each one is
at), and from how the ranks that already ended did end.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field

from ._hang_probe import PEEK, REPORT
from .flight_recorder import torch_dtype_name
from .run_folder import RunFolder, write_atomically
from .stacks import fold_stack, is_importing


# How long a timed-out run waits for its ranks to say what they wait in (a thread of each answers within about
# 1 s; the first dump of a cold rank that had no time to prepare it, some seconds).
ANSWER_WAIT_S = 5.0


def ask(folder: RunFolder, ranks: list[int], what: bytes = REPORT) -> list[int]:
    """Ask each rank's probe thread (`_hang_probe`): through the named pipe the rank made, where it made one (a
    rank on this machine), else as a file in the run folder (a rank on another machine looks for one,
    `_hang_probe._FileRequests`; one that has not started yet replaces it with its pipe as it starts). `what`:
    REPORT for the hang report, PEEK for the waiting line's quiet question. Returns the ranks asked (a rank
    whose pipe nobody reads any more is gone, and skipped)."""
    asked = []
    for rank in ranks:
        path = folder.hang_request(rank)
        try:
            is_pipe = stat.S_ISFIFO(os.lstat(path).st_mode)
        except FileNotFoundError:
            is_pipe = False
        if not is_pipe:
            write_atomically(path, what)
            asked.append(rank)
            continue
        try:
            pipe = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:  # ENXIO: nobody reads it (a rank that is gone); ENOENT: gone meanwhile
            if error.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            continue
        try:
            os.write(pipe, what)
            asked.append(rank)
        except OSError:  # the rank went away meanwhile
            pass
        finally:
            os.close(pipe)
    return asked


def wait_for_answers(folder: RunFolder, ranks: list[int], poll, seconds: float) -> None:
    """Until every rank in `ranks` has written its hang answer, at most `seconds`, calling `poll` (the launcher's
    output streaming) meanwhile so that the ranks' last lines still show."""
    until = time.monotonic() + seconds
    while ranks and time.monotonic() < until and not all(folder.hang_answered(rank) for rank in ranks):
        poll()
        time.sleep(0.05)


@dataclass(frozen=True)
class RankState:
    """One row of the report: what a rank was doing when the run timed out."""

    rank: int
    waiting_in: str  # "all_reduce", "recv from rank 1", "not in a collective", "ended (exit code 0)"
    number: str = ""  # the collective's sequence number in its group ("#7"), or the point-to-point call's
    shape: str = ""  # "[4] float", the inputs' shapes and dtypes
    group: str = ""
    line: str = ""  # where in the learner's code: "line 41 of the cell" (or of the script), "model.py, line 12"
    printed: str = ""  # the last exception a rank still running printed and went on from, if any
    importing: bool = False  # its learner's line is an import still running (a slow start, not a stuck rank)


@dataclass(frozen=True)
class HangReport:
    ranks: tuple[RankState, ...]
    cause: str  # one sentence, or what could not be told
    collectives: dict[int, list[dict]] = field(default_factory=dict, repr=False)  # per rank, as recorded
    ended: str = "timed out"  # how the run ended: "timed out", or "was stopped" (the stop button, Ctrl-C)

    def table(self) -> str:
        header = ("rank", "waiting in", "collective #", "shape / dtype", "group", "line")
        rows = [header] + [(str(r.rank), r.waiting_in, r.number, r.shape, r.group, r.line) for r in self.ranks]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)

    def text(self) -> str:
        return f"What each rank was waiting in when the run {self.ended}:\n{self.table()}\n{self.cause}"


def read_hang_report(folder: RunFolder, world_size: int, script_name: str, exit_codes: dict[int, int | None],
                     errors: dict[int, str], in_cell: bool = False) -> HangReport | None:
    """The report of a timed-out run from its folder; None when no rank answered (nothing to tell). With
    `in_cell` (the script was written from a %%torchrun cell), its lines are named "line 41 of the cell"."""
    answers = {rank: folder.read_hang_answer(rank) for rank in range(world_size)}
    if not any(answers.values()):
        return None
    dumps = {rank: folder.read_text(folder.stack_file(rank)) for rank in range(world_size)}
    lines = {rank: _learner_line(dump, script_name, in_cell) for rank, dump in dumps.items()}
    blocked_in = {rank: _blocked_in(dump) for rank, dump in dumps.items() if dump}
    importing = {rank for rank, dump in dumps.items() if is_importing(dump)}
    return build_report(answers, lines, exit_codes, errors, blocked_in, in_cell=in_cell, importing=importing)


def own_line(number, in_cell: bool) -> str:
    """How the report names a line of the script itself: "line 41 of the cell" for a cell's, else "line 41"."""
    return f"line {number}" + (" of the cell" if in_cell else "")


def _learner_line(dump: str, script_name: str, in_cell: bool = False) -> str:
    """The innermost frame of the learner's code in a stack dump: "line 41 of the cell" in the cell's own script
    (its lines are the cell's; "line 41" for a script file), "model.py, line 12" in another file."""
    shown, _ = fold_stack(dump or "")
    for entry in shown:
        if entry.startswith("  File "):
            name, rest = entry[len('  File "'):].split('", ', 1)
            line = rest.split(" in ")[0]
            return own_line(line.split()[-1], in_cell) if name == script_name else f"{name}, {line}"
    return ""


def _blocked_in(dump: str) -> str:
    """The torch.distributed function the learner's innermost frame is inside, as its stack shows ("all_reduce"),
    or "" (its code is elsewhere: a sleep, a loop, or a C++ wait that has no Python frame)."""
    shown, _ = fold_stack(dump)
    first = next((entry for entry in shown), "")
    return first.split("torch.distributed.", 1)[1] if first.startswith("  waiting in torch.distributed.") else ""


def last_printed_error(stderr: str) -> str | None:
    """The exception line of the last traceback a rank printed ("ValueError: bad batch"), if any."""
    _, found, after = stderr.rpartition("Traceback (most recent call last):")
    if not found:
        return None
    lines = [line for line in after.splitlines() if line.strip() and not line[:1].isspace()]
    return lines[0][:300] if lines else None


def _shape(collective: dict) -> str:
    shapes = ", ".join(str(list(s)) + (" (a scalar)" if not list(s) else "") for s in collective["shapes"])
    dtypes = sorted({torch_dtype_name(d) for d in collective["dtypes"]})
    return f"{shapes} {'/'.join(dtypes)}".strip()


def _waiting_collective(answer: dict | None) -> dict | None:
    waiting = [c for c in (answer or {}).get("collectives", []) if not c["returned"]]
    return waiting[-1] if waiting else None


# A rank whose collective has not finished while its stack shows it elsewhere (async_op=True, never waited
# on; or a GPU stream the rank went on from).
WENT_ON = " (not finished; the rank went on)"
RECORDER_OFF = "unknown: the flight recorder is off"


def build_report(answers: dict[int, dict | None], lines: dict[int, str], exit_codes: dict[int, int | None],
                 errors: dict[int, str], blocked_in: dict[int, str] | None = None, in_cell: bool = False,
                 importing: set[int] = frozenset()) -> HangReport:
    """`answers`: per rank its hang answer (None: it did not answer); `lines`: per rank where its stack says
    it is; `exit_codes`: per rank its exit code if it had ended before the timeout; `errors`: per rank the
    error it raised, if any; `blocked_in`: per rank with a stack, the torch.distributed call the stack shows
    it inside ("" for none). Where the recorder and the stack disagree, the row says what each shows."""
    blocked_in = blocked_in or {}
    rows = []
    for rank in sorted(answers):
        answer, collective = answers[rank], _waiting_collective(answers[rank])
        p2p = (answer or {}).get("point_to_point")
        if exit_codes.get(rank) is not None:
            ended = f"ended (exit code {exit_codes[rank]})"
            rows.append(RankState(rank, f"{ended} after {errors[rank]}" if rank in errors else ended))
        elif collective is not None:
            called_at = own_line(collective["line"], in_cell) if collective.get("line") else lines.get(rank, "")
            went_on = blocked_in.get(rank) == "" and lines.get(rank) and lines.get(rank) != called_at
            rows.append(RankState(rank, collective["op"] + (WENT_ON if went_on else ""), f"#{collective['number']}",
                                  _shape(collective), collective["group"], lines[rank] if went_on else called_at))
        elif answer is not None and answer.get("recorder") is False and p2p is None:
            seen = blocked_in.get(rank)
            rows.append(RankState(rank, RECORDER_OFF + (f" (its stack: in {seen})" if seen else ""),
                                  line=lines.get(rank, "")))
        elif p2p is not None:
            direction = "to" if p2p["op"] == "send" else "from"
            rows.append(RankState(rank, f"{p2p['op']} {direction} rank {p2p['peer']}", f"p2p #{p2p['number']}",
                                  f"{p2p['shape']} {p2p['dtype']}", "world", lines.get(rank, "")))
        elif answer is None:
            rows.append(RankState(rank, "did not answer", line=lines.get(rank, "")))
        else:
            rows.append(RankState(rank, "not in a collective (running Python)", line=lines.get(rank, ""),
                                  printed=errors.get(rank, ""), importing=rank in importing))
    collectives = {rank: (answer or {}).get("collectives", []) for rank, answer in answers.items()}
    cause = _cause(rows, collectives, answers, in_cell)
    return HangReport(tuple(rows), cause[0].upper() + cause[1:], collectives)


def unfinished_line(answers: dict[int, dict]) -> str:
    """The waiting line's clause from the ranks' peek answers (`_hang_probe._unfinished`): per rank, the
    collective it has not finished (on nccl one it launched and went on from counts too), or its blocking send
    or recv; ranks alike are named together. "" when no rank answered."""
    said: dict[str, list[int]] = {}
    for rank in sorted(answers):
        answer = answers[rank]
        collective, p2p = _waiting_collective(answer), answer.get("point_to_point")
        if collective is not None:
            group = "" if collective["group"] == "world" else f" ({collective['group']})"
            what = f"{collective['op']} #{collective['number']}{group}"
        elif p2p is not None:
            what = f"{p2p['op']} {'to' if p2p['op'] == 'send' else 'from'} rank {p2p['peer']}"
        elif answer.get("recorder") is False:
            what = "unknown (the flight recorder is off)"
        else:
            what = "no collective"
        said.setdefault(what, []).append(rank)
    if not said:
        return ""
    return "not finished: " + "; ".join(f"{_names(ranks)} {what}" for what, ranks in said.items())


def _names(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _cause(rows: list[RankState], collectives: dict[int, list[dict]], answers: dict[int, dict | None],
           in_cell: bool = False) -> str:
    by_rank = {row.rank: row for row in rows}
    off = [row for row in rows if row.waiting_in.startswith(RECORDER_OFF)]
    if off:
        where = "; ".join(f"rank {row.rank} at {row.line or 'an unknown line'}" for row in off)
        return ("The flight recorder is off (TORCH_FR_BUFFER_SIZE=0), so the report cannot tell which collective "
                f"{_names([row.rank for row in off])} {'waits' if len(off) == 1 else 'wait'} in: read the stacks below "
                f"({where}). Unset TORCH_FR_BUFFER_SIZE to get the report back.")
    waiting = {row.rank: _waiting_collective(answers[row.rank]) for row in rows if row.number.startswith("#")}
    if waiting:
        cause = _cause_at_collective(by_rank, waiting, collectives, in_cell)
        if cause:
            return cause
    p2p = {row.rank: row for row in rows if row.number.startswith("p2p")}
    if p2p and len(p2p) == sum(1 for row in rows if not row.waiting_in.startswith("ended")):
        ops = {row.waiting_in.split()[0] for row in p2p.values()}
        every = "both" if len(p2p) == 2 else "all"
        where = sorted({row.line for row in p2p.values() if row.line})
        at = f" ({', '.join(where)})" if where else ""
        if ops == {"recv"}:
            return f"{_names(sorted(p2p))} {every} wait in recv{at}, and no rank sends: each waits for a message nobody sends."
        if ops == {"send"}:
            return f"{_names(sorted(p2p))} {every} wait in send{at}, and no rank receives."
    busy = [row.rank for row in rows if row.waiting_in.startswith("not in a collective")]
    silent = [row.rank for row in rows if row.waiting_in == "did not answer"]
    if p2p and busy and not waiting:  # one rank waits for a message, the other is in its own code
        waits = "; ".join(f"rank {rank} waits in {row.waiting_in} ({row.line})" for rank, row in sorted(p2p.items()))
        return f"{waits}, and {'; '.join(f'rank {r} is {_doing(by_rank[r])}' for r in busy)}."
    if busy and silent and not waiting and not p2p:  # a silent rank may well wait in a collective: never say it does not
        return (f"{_names(silent).capitalize()} did not say what {'it waits' if len(silent) == 1 else 'they wait'} in "
                f"(no answer in time): read {'its stack' if len(silent) == 1 else 'their stacks'} below. "
                f"{'; '.join(f'Rank {r} is {_doing(by_rank[r])}' for r in busy)}.")
    starting = [r for r in busy if by_rank[r].importing]
    if busy and starting == busy and not waiting and not p2p:
        return (f"No rank waits in a collective: {_names(starting)} {'was' if len(starting) == 1 else 'were'} still "
                f"starting, importing ({'; '.join(f'rank {r} at {by_rank[r].line}' for r in starting)}). On a busy "
                "machine a cold start can take longer than the timeout: raise --timeout (e.g. --timeout 60).")
    if busy and not waiting and not p2p:
        return (f"No rank waits in a collective: {'; '.join(f'rank {r} is {_doing(by_rank[r])}' for r in busy)}. "
                "Look at those lines: a loop that does not end, or a sleep.")
    return "No single cause could be read from the ranks; their stacks are below."


def _cause_at_collective(by_rank: dict[int, RankState], waiting: dict[int, dict],
                         collectives: dict[int, list[dict]], in_cell: bool = False) -> str | None:
    """The cause read at the earliest collective a rank waits in, or None when the ranks agree there."""
    # The earliest collective anyone waits in, per group: every rank of the group must have called it.
    group, number = min((c["group"], c["number"]) for c in waiting.values())
    called = {rank: next((c for c in collectives[rank] if c["group"] == group and c["number"] == number), None)
              for rank in collectives}
    calls = {rank: c for rank, c in called.items() if c is not None}
    kinds = {(c["op"], _shape(c)) for c in calls.values()}
    if len(kinds) > 1:
        parts = [c["op"] + (f" of {_shape(c)}" if _shape(c) else "") + f" on rank {rank}"
                 + (f" ({own_line(c['line'], in_cell)})" if c.get("line") else "") for rank, c in sorted(calls.items())]
        moved_on = sorted(rank for rank, w in waiting.items() if w["group"] == group and w["number"] > number)
        went_on = (f" {_names(moved_on).capitalize()} returned from it anyway (gloo can pair collectives that do not match) "
                   f"and went on." if moved_on else "")
        return f"The ranks disagree at collective #{number}: {', '.join(parts)}.{went_on}"
    op = next(iter(calls.values()))["op"]
    waiters = sorted(rank for rank in waiting if waiting[rank]["number"] == number and waiting[rank]["group"] == group)
    missing = [rank for rank, c in sorted(called.items()) if c is None and rank not in waiters]
    elsewhere = {rank: waiting[rank] for rank in missing if rank in waiting and waiting[rank]["group"] != group}
    if elsewhere:  # each waits in a collective of its own group: neither can finish
        parts = [f"rank {rank} in {c['op']} #{c['number']} of {_group(c['group'])} ({by_rank[rank].line})"
                 for rank, c in sorted({**{r: waiting[r] for r in waiters}, **elsewhere}.items())]
        return (f"The ranks wait in collectives of different groups: {', '.join(parts)}. Every rank of a group "
                "must call that group's collectives, in the same order.")
    if missing:
        waiter = by_rank[waiters[0]]
        if waiter.waiting_in.endswith(WENT_ON):
            started = next((c for c in collectives[waiters[0]] if c["group"] == group and c["number"] == number), {})
            at = f" at {own_line(started['line'], in_cell)}" if started.get("line") else ""
            state = (f"started{at} and {'has' if len(waiters) == 1 else 'have'} not finished (async_op=True, never "
                     f"waited on, or a GPU stream; {waiter.line} now)")
        else:
            state = f"{'is' if len(waiters) == 1 else 'are'} waiting in" + (f" ({waiter.line})" if waiter.line else "")
        doing = "; ".join(f"rank {rank} is {_doing(by_rank[rank])}" for rank in missing)
        return f"{_names(missing)} never called {op} #{number}, which {_names(waiters)} {state}: {doing}."
    return None


def _group(name: str) -> str:
    return "the world" if name == "world" else name


def _doing(row: RankState) -> str:
    if row.waiting_in == "did not answer":
        return f"silent (no answer; its stack is below){' at ' + row.line if row.line else ''}"
    if row.waiting_in.startswith("ended"):
        return row.waiting_in.replace("ended", "gone: it ended", 1)
    where = f" at {row.line}" if row.line else ""
    if row.waiting_in.startswith("not in a collective"):
        return f"in your code{where}, in no collective" + (f" (it printed {row.printed})" if row.printed else "")
    return f"in {row.waiting_in} {row.number}{where}".replace("  ", " ")
