"""A run whose work finished must not fail at exit.

Without the bootstrap's os._exit, a two-rank DDP run on this kind of machine aborts during interpreter
shutdown in roughly 1 of 13 runs ("terminate called without an active exception", SIGABRT) after all
its work is done. 40 runs make a regression show up with probability above 95%.
"""

from support import failure_report, run_on_cpu

RUNS = 40

SMALL_DDP_SCRIPT = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_helpers import record

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
optimizer.step()
record("done", True)
dist.destroy_process_group()
"""


def test_forty_ddp_runs_in_a_row_all_exit_cleanly(write_script):
    # Two at a time: each run mostly waits on its rendezvous and its interpreters' start-up.
    from concurrent.futures import ThreadPoolExecutor

    script = write_script("small_ddp", SMALL_DDP_SCRIPT)

    def one_run(attempt: int):
        return attempt, run_on_cpu(script, nproc=2, stream=False, run_dir=script.parent / f"run{attempt}")

    failures = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for attempt, run in pool.map(one_run, range(RUNS)):
            if not run.ok:
                failures.append(f"run {attempt}:\n{failure_report(run)}")
            else:
                assert run.facts("done") == [True, True]
    assert not failures, f"{len(failures)} of {RUNS} runs failed:\n" + "\n".join(failures[:2])
