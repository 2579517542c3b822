"""Reading a finished launch back from its run folder into a `RunResult`.

Nothing here raises: a file that is missing, unreadable, or written by another launch is left out,
and a recorded fact that cannot be loaded is reported on its rank (`RankResult.unreadable_facts`)
while every other fact and rank is returned.

Exit codes come from `outcome.json`, written by the supervisor from what the torchrun agent itself
observed (its per-rank failures, negative for a signal), not from torchrun's printed summary.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .cells import is_cell_script
from .hang import last_printed_error, read_hang_report
from .result import STACK_HEADING, RankError, RankResult, RunResult, find_root_cause
from .run_folder import RankIdentity, RunFolder

if TYPE_CHECKING:  # for annotations only: config imports nothing of the read-back side
    from .config import LaunchConfig


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


def collect_result(
    config: LaunchConfig,
    folder: RunFolder,
    *,
    returncode: int | None,
    wall_time_s: float,
    timed_out: bool,
    launcher_log: str | None = None,
    job_state: str = "",
    job_id: str = "",
) -> RunResult:
    """The RunResult of the launch that just ended in `folder`. Exit codes come from the torchrun agents'
    outcome (local runs), else from what each rank wrote as it ended (Slurm jobs)."""
    outcome = folder.read_outcome() or {}
    finished = outcome.get("succeeded") is True
    failures = {int(rank): seen for rank, seen in (outcome.get("failures") or {}).items()}
    died_at = {int(rank): t for rank, t in (outcome.get("died_at") or {}).items()}
    ranks: list[RankResult] = []
    # A rank that never started wrote no identity: its fields are unknown (None), its restarts 0.
    unknown = RankIdentity(rank=-1, pid=0, agent=None, group_rank=None, local_rank=None, restart=0, world_size=0)
    identities = [folder.read_identity(rank) or unknown for rank in range(config.world_size)]
    world_size = config.world_size
    if config.join_after:  # elastic: the world as large as it grew (agents that never joined left no rank)
        world_size = max([identity.world_size for identity in identities] + [config.ranks_per_agent])
    for rank, identity in enumerate(identities[:world_size]):
        exit_code = _exit_code(folder, rank, identity, outcome, finished, failures.get(rank))
        ranks.append(_rank_result(folder, rank, identity, exit_code, died_at.get(rank)))
    root = find_root_cause(ranks)
    if root is not None:
        ranks[root.rank] = replace(root, root_cause=True)
    devices = tuple(f"cuda:{r}" if config.backend == "nccl" else "cpu" for r in range(world_size))
    hang = None
    if timed_out:  # a rank that wrote how it ended had ended on its own before the launcher stopped the run
        ended = {rank: folder.read_exit_code(rank) for rank in range(world_size)}
        printed = {r.rank: last_printed_error(r.stderr) for r in ranks}  # a handled error, or the one that ended it
        hang = read_hang_report(folder, world_size, config.script.name, ended,
                                {rank: error for rank, error in printed.items() if error},
                                in_cell=is_cell_script(config.script))
    return RunResult(
        config=config,
        ranks=tuple(ranks),
        wall_time_s=wall_time_s,
        backend=config.backend,
        devices=devices,
        returncode=returncode,
        timed_out=timed_out,
        launcher_log=folder.read_text(folder.torchrun_log) if launcher_log is None else launcher_log,
        job_state=job_state,
        job_id=job_id,
        run_id=folder.run_id or "",
        hang=hang,
    )


def _exit_code(folder: RunFolder, rank: int, identity: RankIdentity, outcome: dict, finished: bool,
               seen: dict | None) -> int | None:
    """How `rank` ended: as its agent saw it (`outcome`), else as the rank wrote it, else unknown (None)."""
    if finished:
        return 0
    if seen is not None:
        return seen.get("exit_code")
    if "failures" in outcome and identity.agent in outcome.get("unfinished_agents", ()):
        # Its agent was stopped before it could say: finished if the rank wrote how it ended, else stopped.
        return folder.read_exit_code(rank)
    if "failures" in outcome:
        return 0  # the agent listed every rank that failed; this one was not among them
    if not outcome:  # no agent to ask (a Slurm job): how the rank said it ended, if it could
        return folder.read_exit_code(rank)
    return None


def _rank_result(folder: RunFolder, rank: int, identity: RankIdentity, exit_code: int | None,
                 died_at: float | None) -> RankResult:
    error = folder.read_error(rank)
    facts, unreadable = read_facts(folder, rank)
    evidence = folder.read_evidence(rank)
    return RankResult(
        rank=rank,
        exit_code=exit_code,
        stdout=folder.read_text(folder.output(rank, "stdout")),
        stderr=_stderr_with_stack(folder, rank),
        facts=facts,
        error=RankError(error.type, error.message, error.traceback, error.time) if error else None,
        ended_at=error.time if error else died_at,
        unreadable_facts=unreadable,
        files_written=evidence.files_written,
        point_to_point=evidence.point_to_point,
        all_reduced=evidence.all_reduced,
        collectives=evidence.collectives,
        channel_bytes=evidence.channel_bytes,
        agent=identity.agent,
        group_rank=identity.group_rank,
        local_rank=identity.local_rank,
        restart=identity.restart,
        node=identity.node,
    )
