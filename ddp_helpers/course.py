"""The course's side of the launcher. A lesson's first cell runs `%load_ext ddp_helpers.course`: the launcher's
extension (%%torchrun, the warm process), and the course's rank hook (`evidence_hook`) for every launch of the
notebook from then on: the records its exercise checkers judge a run by. A plain `%load_ext ddp_helpers`
notebook runs none of the course's code in its ranks.
"""

from __future__ import annotations

from . import rank_hooks

#: the course's rank hook: its checkers' records of each rank
EVIDENCE_HOOK = "ddp_helpers.evidence_hook"


def keep_records() -> None:
    """Every launch of this process from now on keeps the course's records of each rank."""
    rank_hooks.use(EVIDENCE_HOOK)


def records_kept(run) -> bool:
    """Whether `run` was made with the course's records (every rank that started wrote them)."""
    from .run_folder import RunFolder

    folder = RunFolder(run.run_dir)
    return all(folder.read_secret(rank.rank) is not None for rank in run.ranks)


def load_ipython_extension(ipython) -> None:
    from . import load_ipython_extension as load_launcher

    keep_records()
    load_launcher(ipython, name=__name__)
