"""A real two-node Slurm cluster on this machine, for tests (see shared notes: Debian's Slurm 22.05, two
slurmd with -N, munge, no cgroups). Everything lives under one temporary folder and `SLURM_CONF` points
at it; /etc is never touched.

    cluster = LocalSlurmCluster(base).start()   # about 1 s
    cluster.env                                 # SLURM_CONF for sbatch, squeue, scancel, ...
    cluster.stop()                              # cancels every job first, then stops the daemons
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ddp_helpers.rendezvous_port import rendezvous_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


def slurm_installed() -> bool:
    return all(shutil.which(tool) or Path("/usr/sbin", tool).exists() for tool in DAEMONS)


def _free_port() -> int:
    return rendezvous_port("127.0.0.1")  # below the OS's ephemeral range: no launch of the suite takes it first


def _alive(pid: int) -> bool:
    """Exited daemons can linger as zombies: read the state instead of trusting kill -0."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class LocalSlurmCluster:
    def __init__(self, base: Path, nodes: int = 2, cpus_per_node: int | None = None):
        self.base = Path(base)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus_per_node or max(2, os.cpu_count() or 2)
        self.conf = self.base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pid_files: list[Path] = []

    def _write_config(self) -> None:
        b = self.base
        os.chmod(b, 0o755)  # munge wants its socket's folders open to all (mode 755)
        for folder in ("run", "state", "log", "munge"):
            (b / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "run", 0o755)
        os.chmod(b / "munge", 0o700)
        key = b / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=lessons", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={_free_port()}",
            # cred_expire also sets how long a requeued job waits before it may start again (slurm.conf(5):
            # cred_expire + 1 s, 120 s by default); 10 s keeps the preemption test's requeue short.
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={b / 'run' / 'munge.socket'},cred_expire=10",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SlurmUser=root", "SlurmdUser=root",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MailProg=/bin/true",
            "ReturnToService=2", "KillWait=5", "MinJobAge=300", "SchedulerParameters=sched_interval=1",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={b / 'log' / 'jobcomp.txt'}",
            f"StateSaveLocation={b / 'state'}", f"SlurmdSpoolDir={b / 'state' / 'd' / '%n'}",
            f"SlurmctldPidFile={b / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={b / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={b / 'log' / 'slurmd-%n.log'}",
        ]
        for node in self.nodes:
            (b / "state" / "d" / node).mkdir(parents=True, exist_ok=True)
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={self.cpus} RealMemory=1000")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 30) -> "LocalSlurmCluster":
        self._write_config()
        b = self.base
        munge_pid = b / "run" / "munged.pid"
        subprocess.run(["/usr/sbin/munged", "-S", str(b / "run" / "munge.socket"),
                        "--key-file", str(b / "munge" / "munge.key"), "--pid-file", str(munge_pid),
                        "--log-file", str(b / "log" / "munged.log"), "--seed-file", str(b / "munge" / "seed")],
                       check=True)
        self._pid_files.append(munge_pid)
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env)
        self._pid_files.append(b / "run" / "slurmctld.pid")
        for node in self.nodes:
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", node], check=True, env=self.env)
            self._pid_files.append(b / "run" / f"slurmd-{node}.pid")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            idle = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], env=self.env, capture_output=True,
                                  text=True, timeout=15).stdout.strip()
            if idle == str(len(self.nodes)):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm cluster did not come up in {timeout_s} s: see {b / 'log'}")

    def jobs(self) -> list[str]:
        done = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=15)
        return done.stdout.split()

    def stop(self) -> None:
        """Cancel every job and wait for an empty queue before stopping the daemons (killing slurmstepd
        first would orphan the job's processes), then stop the daemons."""
        try:
            subprocess.run(["scancel", "--user", str(os.getuid())], env=self.env, timeout=15, capture_output=True)
            deadline = time.monotonic() + 20
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass
        pids = []
        for pid_file in reversed(self._pid_files):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            pids.append(pid)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
