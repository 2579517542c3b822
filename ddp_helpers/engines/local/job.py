"""The default job: a run on this machine, torchrun agents on loopback (`engine.LocalEngine`). Its options
(`%%torchrun --nnodes --kill-rank --kill-after --join-after --cold`) and its checks against this machine's
GPUs live here, with the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...errors import LaunchError
from .. import (DEFAULT_CPU_NPROC, Engine, Job, LaunchConfig, LaunchRequest, max_cpu_ranks, option_text, parse_nproc,
                register_job)

MAX_NNODES = 8


@dataclass(frozen=True)
class Hardware:
    """The devices this machine offers to a launch."""

    gpu_names: tuple[str, ...]

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    @property
    def default_backend(self) -> str:
        """nccl with a GPU for each of at least 2 ranks; otherwise CPU ranks over gloo."""
        return "nccl" if self.gpu_count >= 2 else "gloo"

    def describe(self) -> str:
        if not self.gpu_names:
            return "no CUDA GPU: ranks run as CPU processes and talk over gloo"
        listing = ", ".join(f"cuda:{i} {name}" for i, name in enumerate(self.gpu_names))
        if self.gpu_count == 1:
            return (f"1 CUDA GPU ({listing}): one GPU makes a world of one, so by default the ranks run as 2 CPU "
                    "processes over gloo (--backend nccl -n 1 uses the GPU)")
        return f"{self.gpu_count} CUDA GPUs: {listing}; ranks use nccl, one GPU each"


def detect_hardware() -> Hardware:
    """Find the CUDA GPUs without creating a CUDA context in this process (a context here would be
    inherited by nothing, but costs memory and time on every GPU)."""
    import torch

    count = torch.cuda.device_count()
    return Hardware(tuple(torch.cuda.get_device_name(i) for i in range(count)))


def parse_nnodes(value: object) -> int:
    """torchrun agents ("machines") to start on loopback: a whole number from 1 to MAX_NNODES."""
    text = str(value).strip() if not isinstance(value, bool) else repr(value)
    if not re.fullmatch(r"\d+", text) or not 1 <= int(text) <= MAX_NNODES:
        raise LaunchError(f"nnodes must be a whole number of agents from 1 to {MAX_NNODES}, got {value!r}. "
                          "Example: --nnodes 2 (two agents standing for two machines)")
    return int(text)


def parse_kill(rank: object, after: object, world_size: int) -> tuple[int | None, str | None]:
    if rank is None and after is None:
        return None, None
    if rank is None or after is None:
        raise LaunchError("kill_rank and kill_after go together: which rank to kill, and the output text after "
                          "which to kill it. Example: --kill-rank 1 --kill-after 'step 5 done'")
    text = str(rank).strip() if not isinstance(rank, bool) else repr(rank)
    if not re.fullmatch(r"\d+", text) or int(text) >= world_size:
        raise LaunchError(f"kill_rank must be a rank of this run, 0 to {world_size - 1}, got {rank!r}.")
    return int(text), _line_of_text("kill_after", after, "the rank")


def _local_ranks(nproc, backend: str | None, nnodes: int, hardware: Hardware) -> tuple[int, str]:
    """(ranks per agent, backend) for a run on this machine, defaults from its GPUs."""
    if backend is None:
        wanted = DEFAULT_CPU_NPROC if nproc is None else parse_nproc(nproc)
        backend = (hardware.default_backend if nproc is None
                   else ("nccl" if wanted * nnodes <= hardware.gpu_count else "gloo"))
    if backend == "nccl" and hardware.gpu_count == 0:
        raise LaunchError(
            "backend 'nccl' needs CUDA GPUs and none was found. Use backend='gloo' (magic: --backend gloo) "
            "to run the ranks as CPU processes."
        )
    if nproc is None:
        nproc = max(1, hardware.gpu_count // nnodes) if backend == "nccl" else DEFAULT_CPU_NPROC
    nproc = parse_nproc(nproc)
    if backend == "nccl" and nproc * nnodes > hardware.gpu_count:
        raise LaunchError(
            f"{nproc * nnodes} ranks asked for but only {hardware.gpu_count} GPU(s) found: with nccl each rank "
            f"needs its own GPU. Use nproc x nnodes <= {hardware.gpu_count}, or backend='gloo' (magic: "
            "--backend gloo) to run the ranks as CPU processes."
        )
    if nproc * nnodes > max_cpu_ranks():
        raise LaunchError(f"{nnodes} agents x {nproc} ranks is more processes than this machine can run (at most "
                          f"{max_cpu_ranks()} ranks here). Example: --nnodes 2 --nproc 2")
    return nproc, backend


def _line_of_text(name: str, value: object, who: str) -> str:
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise LaunchError(f"{name} must be a non-empty line of text {who} prints, got {value!r}.")
    return value


@register_job
@dataclass(frozen=True)
class LocalJob(Job):
    """A run on this machine: `nnodes` torchrun agents on loopback, each standing for a machine.

    Args:
        nnodes (int): agents (torchrun's --nnodes, one c10d rendezvous); with nccl each gets its own GPUs.
        kill_rank (int | None), kill_after (str | None): SIGKILL global rank `kill_rank`, once, as soon as
            its output contains `kill_after` (as the out-of-memory killer would): for restart demos.
        join_after (str | None): elastic membership: agents 1 .. nnodes - 1 start only once rank 0's output
            contains this text, and the rendezvous accepts 1 to nnodes agents (torchrun --nnodes 1:N); the
            running ranks restart in the bigger world.
        warm (bool): fork the supervisor and the ranks from a process that has torch imported (`warm`),
            where that gives the same result; False always starts fresh interpreters (--cold).
        hardware (Hardware | None): the devices to plan for; detected when omitted.
    """

    label = "runs on this machine"
    is_default = True

    nnodes: int | str = 1
    kill_rank: int | str | None = None
    kill_after: str | None = None
    join_after: str | None = None
    warm: bool = True
    hardware: Hardware | None = field(default=None, compare=False, repr=False)

    def options_given(self) -> list[str]:
        """The options set away from a plain run on this machine, by their names."""
        given = {"nnodes": str(self.nnodes).strip() != "1", "kill_rank": self.kill_rank is not None,
                 "kill_after": self.kill_after is not None, "join_after": self.join_after is not None,
                 "cold": not self.warm}
        return [name for name, set_ in given.items() if set_]

    @classmethod
    def add_arguments(cls, options) -> None:
        options.add_argument("--cold", action="store_true",
                             help="start every process as a fresh interpreter (by default the ranks are forked from "
                                  "a process that has torch imported, when that gives the same result)")
        options.add_argument("--nnodes", default=1,
                             help="torchrun agents, each standing for a machine with --nproc ranks, on this "
                                  "machine's loopback (one c10d rendezvous; default 1)")
        options.add_argument("--kill-rank", default=None,
                             help="SIGKILL this (global) rank once, as the out-of-memory killer would, when its "
                                  "output first contains --kill-after: to see a restart (--max-restarts) for real")
        options.add_argument("--kill-after", default=None,
                             help="the text (quoted) after which --kill-rank is killed, e.g. --kill-after 'step 5 done'")
        options.add_argument("--join-after", default=None,
                             help="elastic membership: agents 1 .. nnodes-1 start only once rank 0's output "
                                  "contains this text (quoted), and join the running job (torchrun --nnodes 1:N)")

    @classmethod
    def from_arguments(cls, args) -> LocalJob:
        return cls(nnodes=args.nnodes, kill_rank=args.kill_rank, kill_after=option_text(args.kill_after),
                   join_after=option_text(args.join_after), warm=not args.cold)

    def launch_config(self, request: LaunchRequest) -> LaunchConfig:
        """A launch on this machine: torchrun agents on loopback (see `engine`)."""
        env = dict(request.extra_env)
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if key in env:
                raise LaunchError(
                    f"extra_env may not set {key} for a run on this machine: the launcher keeps gloo's and nccl's "
                    "connections on loopback (lo), so that nothing of the run is reachable from the network. On a "
                    "cluster, set it to the nodes' network interface."
                )
        hardware = self.hardware or detect_hardware()
        nnodes = parse_nnodes(self.nnodes)
        nproc, backend = _local_ranks(request.nproc, request.backend, nnodes, hardware)
        kill_rank, kill_after = parse_kill(self.kill_rank, self.kill_after, nproc * nnodes)
        join_after = self.join_after
        if join_after is not None:
            if nnodes < 2:
                raise LaunchError("join_after needs agents to join: nnodes 2 or more. Example: --nnodes 2 "
                                  "--join-after 'step 5 done'")
            _line_of_text("join_after", join_after, "rank 0")
        if backend == "gloo" and hardware.gpu_count:
            # CPU ranks on a GPU machine: hide the GPUs so `torch.cuda.is_available()` picks the CPU path.
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        checked = LocalJob(nnodes=nnodes, kill_rank=kill_rank, kill_after=kill_after, join_after=join_after,
                           warm=bool(self.warm), hardware=hardware)
        return request.config(checked, ranks_per_agent=nproc, backend=backend, nnodes=nnodes, extra_env=env)

    def engine(self, config: LaunchConfig, folder) -> Engine:
        from .engine import LocalEngine  # the engine's modules load only for a launch

        return LocalEngine(config, folder)
