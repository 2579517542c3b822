"""What the launcher asks of the supervisor, as one typed spec: the local engine writes it into the run
folder (`RunFolder.supervisor_spec`) and starts `python -m ddp_helpers.engines.local.supervisor SPEC_FILE`; the supervisor
reads it back and turns it into torchrun's arguments for each agent. Stdlib only (a warm process and the
supervisor both load it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ...run_folder import open_private


@dataclass(frozen=True)
class SupervisorSpec:
    """One local launch, as the supervisor runs it.

    Args:
        parent_pid (int): the process the supervisor dies with (the kernel, or the warm process that forked it).
        run_id (str): the launch's marker (also in every rank's environment).
        shutdown_grace_s (float): the ranks' time to end on SIGTERM before SIGKILL (torchrun's shutdown timeout).
        nnodes (int): torchrun agents, each standing for a machine.
        ranks_per_agent (int): torchrun's --nproc-per-node.
        max_restarts (int): torchrun's --max-restarts.
        join_after (str | None): agents 1 .. nnodes - 1 start once rank 0 has printed this text, and the
            rendezvous accepts 1 to nnodes agents (torchrun --nnodes 1:N).
        agent_gpus (tuple[str, ...] | None): each agent's CUDA_VISIBLE_DEVICES (nccl with several agents).
        worker (tuple[str, ...]): what torchrun runs for each rank: its entrypoint and arguments.
        log_dir (str): torchrun's --log-dir (removed at the end).
    """

    parent_pid: int
    run_id: str
    shutdown_grace_s: float
    nnodes: int
    ranks_per_agent: int
    max_restarts: int
    worker: tuple[str, ...]
    log_dir: str
    join_after: str | None = None
    agent_gpus: tuple[str, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_agent

    def torchrun_argv(self, rendezvous_port: int) -> list[str]:
        """torchrun's arguments for every agent: a c10d rendezvous on the store the supervisor hosts on loopback."""
        return [
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port}", "--rdzv-id", self.run_id,
            # last_call_timeout: once the minimum of agents is there, how long to wait for more (default 30 s).
            "--rdzv-conf", "is_host=false,last_call_timeout=1",
            "--nnodes", f"1:{self.nnodes}" if self.join_after else str(self.nnodes),
            "--nproc-per-node", str(self.ranks_per_agent),
            "--max-restarts", str(self.max_restarts),
            "--monitor-interval", "0.1",
            "--local-addr", "127.0.0.1",
            "--log-dir", self.log_dir,
            *self.worker,
        ]

    def write(self, path: Path) -> None:
        with open_private(path, "w") as spec:
            spec.write(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: str | Path) -> "SupervisorSpec":
        fields = json.loads(Path(path).read_text())
        fields["worker"] = tuple(fields["worker"])
        if fields.get("agent_gpus") is not None:
            fields["agent_gpus"] = tuple(fields["agent_gpus"])
        return cls(**fields)
