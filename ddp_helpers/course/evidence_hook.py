"""The course's rank hook (`rank_hooks`): the records its exercise checkers judge a run by, kept by each rank of
a launch the course makes (`%load_ext ddp_helpers.course` turns it on for the notebook's launches; a plain
`%%torchrun` runs none of it):
- every file the script opens for writing or renames into place (a Python audit hook, `WriteObserver`), and
  each crossing into other ranks' files in the run folder: a checker sees who wrote a file instead of trusting
  what the script says about itself;
- what the script hands to collectives (`_all_reduce_log`), the bytes its store and point-to-point calls move
  (`_channel_bytes`), its point-to-point calls (`_point_to_point`, which the hang report reads too), and every
  collective the flight recorder holds, written with the rest when the script ends (`records.write`);
- the rank's secret (`ddp_helpers.rank_secret`, which an exercise's data comes from), handed to this process only.
"""

from __future__ import annotations

import functools
import os
import sys

from .. import _hang_probe, _point_to_point
from . import _all_reduce_log, _channel_bytes, _held_activations, _held_memory, records
from ..rank_hooks import PatchOnImport
from ..run_folder import SECRET_ENV, RunFolder

_observer: WriteObserver | None = None
# Its wrappers around torch functions: the bootstrap leaves their frames out of a rank's traceback.
WRAPPERS = (__name__, _all_reduce_log.__name__, _channel_bytes.__name__)


def start(folder: RunFolder, rank: int) -> None:
    global _observer
    # Only this process is handed it: an exercise's data comes from it (ddp_helpers.rank_secret), so that no
    # rank can compute another's without asking it, through a collective.
    os.environ[SECRET_ENV] = str(records.draw_secret(folder, rank))
    _observer = WriteObserver(folder, rank)
    sys.addaudithook(_observer)
    PatchOnImport.install({"torch.serialization": _wrap_torch_save, "torch.distributed.distributed_c10d": _observe_collectives})


def finish(folder: RunFolder, rank: int) -> None:
    if _observer is not None:
        records.write(folder, rank, files_written=_observer.paths, point_to_point=_point_to_point.summary(),
                      all_reduced=_all_reduce_log.summary(), collectives=_collectives_called(rank),
                      channel_bytes=_channel_bytes.summary(), held_after_steps=_held_memory.summary(),
                      held_for_backward=_held_activations.summary())


def _observe_collectives(c10d_module) -> None:
    _all_reduce_log.observe(c10d_module)
    _channel_bytes.observe(c10d_module)


def _collectives_called(rank: int) -> list[dict]:
    try:
        return _hang_probe.collectives_called()
    except Exception as error:  # noqa: BLE001 - a checker's evidence: never a reason for the rank to fail
        print(f"[ddp_helpers] rank {rank}: reading the flight recorder failed: {error!r}", file=sys.stderr)
        return []


class WriteObserver:
    """Notes the files a rank writes (Python audit events "open" for writing, "os.rename"/"os.replace"),
    leaving out the run folder's own bookkeeping (`RunFolder.is_bookkeeping`); and each crossing into other
    ranks' files in the run folder (their secrets, outputs, facts: opened, linked to, renamed, removed) or a
    change to its own secret: a side channel no real job has, which checkers name. Crossings are appended to
    the rank's `crossings` file as they happen (`records.note_crossing`), so that neither an `os._exit`, a
    forked child's end nor a restart loses them."""

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self, folder: RunFolder, rank: int):
        self.folder, self.rank = folder, rank
        self.paths: set[str] = set()
        self._noting = False  # noting a crossing opens a file: that open is ours
        # Whether the script opened anything for writing, bookkeeping aside (a descriptor, a path): only then can
        # a buffered file of its be left unflushed at the end (`_finish_like_the_interpreter`).
        self.opened_for_writing = False

    def __call__(self, event: str, args: tuple) -> None:
        if self._noting:
            return
        try:
            self._observe(event, args)
        except Exception:  # noqa: BLE001 - a hook that raises would fail the script's own operation
            pass

    def _observe(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & self._WRITE_FLAGS)
            if writes and isinstance(path, (str, bytes, os.PathLike)):
                self._note(path)
            elif writes:  # os.fdopen(fd, "w") and the like: no path to tell bookkeeping by
                self.opened_for_writing = True
            if isinstance(path, (str, bytes, os.PathLike)):
                self._note_crossing(path, "changed" if writes else "opened")
        elif event == "socket.__new__":  # a socket's makefile("w") buffers too, with no "open" event
            self.opened_for_writing = True
        elif event == "os.rename":
            self._note_crossing(args[0], "moved")
            self._note_crossing(args[1], "replaced")
            self._note(args[1])
        elif event in ("os.link", "os.symlink"):  # another name for a rank's file, or a file in its place
            source, link = args[0], args[1]
            if event == "os.symlink" and isinstance(link, (str, bytes)):  # a relative target is the link's folder's
                source = os.path.join(os.path.dirname(os.fsdecode(link)), os.fsdecode(source))
            self._note_crossing(source, "linked to")
            self._note_crossing(link, "replaced")
        elif event in ("os.remove", "os.truncate"):
            self._note_crossing(args[0], "changed")

    def _note_crossing(self, path, how: str) -> None:
        try:
            owner = self.folder.rank_file_owner(path)
        except (TypeError, ValueError, OSError):
            return
        if owner is None or how == "opened" and owner[0] == self.rank:
            return
        if owner[0] == self.rank and not records.is_secret(owner[1]):
            return  # its own output, records, facts: the launcher's writing, or harmless
        self._noting = True
        try:
            records.note_crossing(self.folder, self.rank, owner[1], how)
        finally:
            self._noting = False

    def _note(self, path) -> None:
        try:
            full = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if not self.folder.is_bookkeeping(full):
            self.paths.add(full)
            self.opened_for_writing = True


def _wrap_torch_save(serialization) -> None:
    serialization.save = _reporting_save(serialization.save)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "save"):
        torch.save = serialization.save


def _reporting_save(save):
    @functools.wraps(save)
    def reporting_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            sys.audit("open", os.fspath(f), "wb", 0)
        return save(obj, f, *args, **kwargs)

    return reporting_save
