"""Several torchrun agents on loopback (`nnodes`), restarts, and a rank killed on purpose: one result
holds every global rank, labelled with its agent and attempt; a killed rank is restarted and the run
ends as an uninterrupted one would."""


import pytest

from support import failure_report, run_on_cpu

IDENTITY = """
import os
import torch
import torch.distributed as dist
from ddp_helpers import record

dist.init_process_group("gloo")
record("env", {name: int(os.environ[name]) for name in
               ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")})
total = torch.tensor([dist.get_rank()])
dist.all_reduce(total)
record("sum", total.item())
print(f"rank {dist.get_rank()} on group {os.environ['GROUP_RANK']}")
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    raise RuntimeError(f"rank {dist.get_rank()} fails on purpose")
dist.barrier()
dist.destroy_process_group()
"""

# Trains 12 steps, rank 0 snapshotting atomically after each; a restarted attempt resumes from it.
RESUMING = """
import os
import time
import torch
import torch.distributed as dist
from ddp_helpers import record

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if os.path.exists("snapshot.pt"):
    snapshot = torch.load("snapshot.pt", weights_only=True)
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    start = snapshot["step"] + 1
for step in range(start, 12):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, "snapshot.tmp")
        os.replace("snapshot.tmp", "snapshot.pt")
    dist.barrier()
    print(f"step {step} done", flush=True)
    time.sleep(0.05)
record("final", torch.cat([p.detach().flatten() for p in model.parameters()]))
dist.destroy_process_group()
"""


def test_two_agents_make_one_world_with_every_rank_labelled(write_script):
    run = run_on_cpu(write_script("identity", IDENTITY), nproc=2, nnodes=2, stream=False)
    assert run.ok, failure_report(run)
    assert len(run.ranks) == 4 and run.facts("sum") == [6] * 4
    for r in run.ranks:
        env = r.facts["env"]
        assert env["RANK"] == r.rank == env["GROUP_RANK"] * env["LOCAL_WORLD_SIZE"] + env["LOCAL_RANK"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (4, 2)
        assert (r.group_rank, r.local_rank) == (env["GROUP_RANK"], env["LOCAL_RANK"])
        assert f"rank {r.rank} on group {env['GROUP_RANK']}" in r.stdout
    assert sorted(r.agent for r in run.ranks) == [0, 0, 1, 1]
    assert {r.agent for r in run.ranks if r.group_rank == 0} != {r.agent for r in run.ranks if r.group_rank == 1}
    assert "4 rank(s) on 2 agents" in run.summary()


@pytest.mark.parametrize("failing", ["1", "3"])
def test_a_rank_failing_after_the_others_finished_ends_the_run_at_once(write_script, failing):
    # The other agent's ranks are done: it would wait 5 minutes at torchrun's exit barrier for the failed one,
    # and this run's 90 s timeout would stop it. (Not a bound on speed: a loaded machine takes 30 s and more.)
    late = IDENTITY.replace("dist.barrier()\n", "")
    run = run_on_cpu(write_script("late", late), nproc=2, nnodes=2, stream=False, timeout_s=90,
                     extra_env={"FAIL_RANK": failing})
    assert not run.ok and not run.timed_out, failure_report(run)
    assert run.first_failure.rank == int(failing)


def test_a_rank_failing_under_the_second_agent_is_named(write_script):
    run = run_on_cpu(write_script("identity", IDENTITY), nproc=2, nnodes=2, stream=False, extra_env={"FAIL_RANK": "3"})
    assert not run.ok
    assert run.first_failure is not None and run.first_failure.rank == 3, failure_report(run)
    assert "rank 3 fails on purpose" in run.summary()
    # The first agent's ranks were stopped mid-run (waiting for rank 3 in a collective): not "ok".
    assert all(r.status != "ok" for r in run.ranks if r.agent == run.ranks[3].agent ^ 1), \
        [(r.rank, r.agent, r.status) for r in run.ranks]


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_killed_rank_is_restarted_and_training_resumes_to_the_same_weights(write_script, nnodes):
    script = write_script("resuming", RESUMING)
    killed = run_on_cpu(script, nproc=2, nnodes=nnodes, stream=False, max_restarts=1, kill_rank=1,
                        kill_after="step 4 done")
    assert killed.ok, failure_report(killed)
    restarts = [(r.rank, r.agent, r.restart, len(r.attempts)) for r in killed.ranks]
    assert killed.restarts == 1 and all(attempts == 2 for *_, attempts in restarts), restarts
    # The killed rank's agent counts a restart. The other agent's ranks count one too if they failed first
    # (their peer was gone), or none if their agent saw the new rendezvous first: torchrun does not count a
    # membership change as a retry (elastic/agent/server/api.py). Both happen, depending on timing.
    killed_agent = killed.ranks[1].agent
    assert all(restart == 1 for _, agent, restart, _ in restarts if agent == killed_agent), restarts
    assert all(restart in (0, 1) for *_, restart, _ in restarts), restarts
    first, second = killed.ranks[1].attempts
    assert "step 4 done" in first and "step 11 done" not in first
    assert "step 11 done" in second and "step 0 done" not in second, "the second attempt resumes"
    assert "restarted 1 time(s)" in killed.summary()
    uninterrupted = run_on_cpu(script, nproc=2, nnodes=nnodes, stream=False)
    assert uninterrupted.ok and uninterrupted.restarts == 0, failure_report(uninterrupted)
    assert killed.facts("final")[0].tolist() == uninterrupted.facts("final")[0].tolist()


# Each step's global batch cut into WORLD_SIZE pieces; slow steps (0.15 s), so that a joining agent arrives
# while the job runs, even on a loaded machine.
ELASTIC = """
import os
import time
import torch
import torch.distributed as dist
from ddp_helpers import record

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
start, log = 0, []
if os.path.exists("snapshot.pt"):
    snapshot = torch.load("snapshot.pt", weights_only=True)
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    start, log = snapshot["step"] + 1, snapshot["log"]
for step in range(start, 40):
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(step))[rank * 24 // world:(rank + 1) * 24 // world]
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
    log.append([step, world])
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log},
                   "snapshot.tmp")
        os.replace("snapshot.tmp", "snapshot.pt")
    dist.barrier()
    print(f"step {step} done", flush=True)
    time.sleep(0.15)
record("log", log)
dist.destroy_process_group()
"""


def test_an_agent_joining_a_running_job_grows_the_world_and_training_goes_on(write_script):
    run = run_on_cpu(write_script("elastic", ELASTIC), nproc=2, nnodes=2, join_after="step 1 done", stream=False)
    assert run.ok, failure_report(run)
    log = run.ranks[0].facts["log"]
    assert [step for step, _ in log] == list(range(40)), "every step once, none lost or repeated"
    worlds = [world for _, world in log]
    assert worlds[0] == 2 and worlds[-1] == 4 and worlds == sorted(worlds), worlds
    assert [r.agent for r in run.ranks].count(1) == 2
    # Rank 0 restarted into the grown world; the joining agent's ranks never ran in its first attempt. (Under
    # load the joining agent can miss the round its arrival started, and join at the next: one more restart.)
    attempts = [len(r.attempts) for r in run.ranks]
    assert attempts[0] >= 2 and attempts[3] < attempts[0], f"attempts per rank: {attempts}"


def test_without_restarts_a_killed_rank_is_named_as_killed(write_script):
    run = run_on_cpu(write_script("resuming", RESUMING), nproc=2, stream=False, kill_rank=0, kill_after="step 2 done")
    assert not run.ok
    assert run.first_failure.rank == 0 and run.first_failure.status.startswith("killed by SIGKILL"), failure_report(run)


def test_agents_that_never_join_leave_a_successful_run_alone(write_script):
    run = run_on_cpu(write_script("identity", IDENTITY), nproc=2, nnodes=2, join_after="text never printed",
                     stream=False)
    assert run.ok, failure_report(run)
    assert [r.rank for r in run.ranks] == [0, 1], "the world never grew: ranks 2 and 3 never existed"
    assert [env["WORLD_SIZE"] for env in run.facts("env")] == [2, 2]
