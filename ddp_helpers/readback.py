"""Reading a finished launch back from its run folder into a `RunResult`.

Nothing here raises: a file that is missing, unreadable, or written by another launch is left out,
and a recorded fact that cannot be loaded is reported on its rank (`RankResult.unreadable_facts`)
while every other fact and rank is returned.

How each rank ended comes from the engine's `Ending` (the local engine: what the torchrun agents
observed, their per-rank failures, negative for a signal; not torchrun's printed summary). Everything
else comes from what the ranks wrote into the run folder, the same for every engine.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .cells import is_cell_script
from .hang import last_printed_error, read_hang_report
from .result import STACK_HEADING, RankError, RankResult, RunResult, find_root_cause
from .run_folder import RankIdentity, RunFolder

if TYPE_CHECKING:  # annotations only
    from .engines import Ending, LaunchConfig


def read_facts(folder: RunFolder, rank: int) -> tuple[dict, dict]:
    """(facts by name, {name: why it could not be read}) for one rank."""
    facts, unreadable = {}, {}
    directory = folder.facts_dir(rank)
    if not directory.is_dir():
        return facts, unreadable
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.suffix not in (".json", ".pt"):
            continue  # a temporary file of an interrupted write
        try:
            facts[path.stem] = _load_fact(path)
        except Exception as error:  # noqa: BLE001 - one bad fact must not lose the run
            unreadable[path.stem] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return facts, unreadable


def _load_fact(path: Path):
    if path.suffix == ".json":
        return json.loads(path.read_text())
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _stderr_with_stack(folder: RunFolder, rank: int) -> str:
    stderr = folder.read_text(folder.output(rank, "stderr"))
    stack = folder.read_text(folder.stack_file(rank))
    if stack:
        stderr += f"{STACK_HEADING.format(rank=rank)}\n{stack}"
    return stderr


def collect_result(config: LaunchConfig, folder: RunFolder, ending: Ending, *, wall_time_s: float,
                   timed_out: bool) -> RunResult:
    """The RunResult of the launch that just ended in `folder`, as its engine saw it end (`ending`)."""
    ranks: list[RankResult] = []
    # A rank that never started wrote no identity: its fields are unknown (None), its restarts 0.
    unknown = RankIdentity(rank=-1, pid=0, agent=None, group_rank=None, local_rank=None, restart=0, world_size=0)
    for rank, ended in enumerate(ending.ranks):
        identity = folder.read_identity(rank) or unknown
        ranks.append(_rank_result(folder, rank, identity, ended.exit_code, ended.died_at))
    root = find_root_cause(ranks)
    if root is not None:
        ranks[root.rank] = replace(root, root_cause=True)
    world_size = len(ranks)
    # A GPU is numbered on its own machine: LOCAL_RANK, not the global rank (cuda:2 does not exist on a machine
    # with 2 GPUs whose agent started ranks 2 and 3). A rank that never started: its place on its agent.
    devices = tuple(f"cuda:{r.local_rank if r.local_rank is not None else r.rank % config.ranks_per_agent}"
                    if config.backend == "nccl" else "cpu" for r in ranks)
    hang = None
    if timed_out:  # a rank that wrote how it ended had ended on its own before the launcher stopped the run
        ended = {rank: folder.read_exit_code(rank) for rank in range(world_size)}
        printed = {r.rank: last_printed_error(r.stderr) for r in ranks}  # a handled error, or the one that ended it
        hang = read_hang_report(folder, world_size, config.script.name, ended,
                                {rank: error for rank, error in printed.items() if error},
                                in_cell=is_cell_script(config.script))
    result = RunResult(
        config=config,
        ranks=tuple(ranks),
        wall_time_s=wall_time_s,
        backend=config.backend,
        devices=devices,
        job_succeeded=ending.succeeded,
        timed_out=timed_out,
        launcher_log=ending.launcher_log,
        job_state=ending.reason,
        job_id=ending.job_id,
        where=ending.where,
        never_started=ending.never_started,
        run_id=folder.run_id or "",
        hang=hang,
    )
    for reader in _READERS:
        try:
            reader(result, folder)
        except Exception:  # noqa: BLE001 - a client's records are never a reason to lose the run
            traceback.print_exc()
    return result


# Clients' readers of their own records, run on every launch this process reads back (`read_also`).
_READERS: list[Callable[[RunResult, RunFolder], None]] = []


def read_also(reader: Callable[[RunResult, RunFolder], None]) -> None:
    """Run `reader(result, folder)` as every later launch of this process is read back, while its run folder holds
    that launch's files (a later launch into the same folder replaces them): a client reads the records its rank
    hook kept (the course's: `course.records`). Once, however often asked."""
    if reader not in _READERS:
        _READERS.append(reader)


def _rank_result(folder: RunFolder, rank: int, identity: RankIdentity, exit_code: int | None,
                 died_at: float | None) -> RankResult:
    error = folder.read_error(rank)
    facts, unreadable = read_facts(folder, rank)
    return RankResult(
        rank=rank,
        exit_code=exit_code,
        stdout=folder.read_text(folder.output(rank, "stdout")),
        stderr=_stderr_with_stack(folder, rank),
        facts=facts,
        error=RankError(error.type, error.message, error.traceback, error.time) if error else None,
        ended_at=error.time if error else died_at,
        unreadable_facts=unreadable,
        agent=identity.agent,
        group_rank=identity.group_rank,
        local_rank=identity.local_rank,
        restart=identity.restart,
        node=identity.node,
    )
