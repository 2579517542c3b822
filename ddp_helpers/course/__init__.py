"""The course's side of the launcher. A lesson's first cell runs `%load_ext ddp_helpers.course`: the launcher's
extension (%%torchrun, the warm process), and the course's rank hook (`evidence_hook`) for every launch of the
notebook from then on: the records its exercise checkers judge a run by. A plain `%load_ext ddp_helpers`
notebook runs none of the course's code in its ranks.
"""

from __future__ import annotations

from .. import rank_hooks

#: the course's rank hook: its checkers' records of each rank
EVIDENCE_HOOK = "ddp_helpers.course.evidence_hook"


def keep_records() -> None:
    """Every launch of this process from now on keeps the course's records of each rank, read back as it ends
    (`records.records(run)`)."""
    from ..readback import read_also  # the kernel's side only: a rank imports this package, and stays light
    from .records import read_run

    rank_hooks.use(EVIDENCE_HOOK)
    read_also(read_run)


def load_ipython_extension(ipython) -> None:
    from .. import load_ipython_extension as load_launcher

    keep_records()
    load_launcher(ipython, name=__name__)
