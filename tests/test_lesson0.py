"""Lesson 0's exercise (every rank learns the mean of numbers only each rank knows): each rank's number comes
from its secret, which only that rank's process is handed, so no rank can write the others' numbers down. The
exercise as given and the wrong fixes are judged wrong, each with its mistake named (never the fix); every
collective route to the mean passes, at the cell's world size and at the one the checker runs it at too."""

import re

import pytest

from ddp_helpers.course.lessons.lesson0 import check_mean_exercise, number_of
from ddp_helpers.course.records import records
from support import exercise_cells, failure_report, run_on_cpu

GIVEN_MEAN = "mean = number  # every rank should end with the mean of all the ranks' numbers\n"


@pytest.fixture(scope="module")
def sources():
    _, given, (solution, *_) = exercise_cells("00_check_setup.ipynb", "%%torchrun --nproc 2 --backend gloo --name exercise")
    assert GIVEN_MEAN in given
    return given, solution.split("\n", 1)[1]  # the solution without its %%torchrun line


def judged(write_script, source: str, nproc: int = 2):
    run = run_on_cpu(write_script("exercise", source), nproc=nproc, stream=False)
    return run, check_mean_exercise(run)


def test_the_exercise_as_given_is_judged_wrong(write_script, sources):
    run, report = judged(write_script, sources[0])
    assert run.ok and not report.passed, failure_report(run)
    # At 2 ranks, or at 3 in the checker's second run where the 2 ranks' numbers happened to be equal (1 in 99):
    # then the given cell's "mean" is right at 2, and the second world size shows the mistake.
    assert re.search(r"ranks 0, 1(, 2)? still hold only their own number", str(report)), str(report)
    assert "how can every rank learn the others'?" in str(report)
    assert "all_reduce" not in str(report) and "divide" not in str(report), "the hints name the mistake, not the fix"


def test_each_run_draws_new_numbers_that_the_checker_reads_back(write_script, sources):
    secrets = []
    for _ in range(2):
        run, _ = judged(write_script, sources[0])
        secrets.append([seen.secret for seen in records(run)])
        printed = [r.stdout.split("my number ")[1].split(",")[0] for r in run.ranks]
        assert printed == [f"{number_of(secret):g}" for secret in secrets[-1]], printed
    assert len({*secrets[0], *secrets[1]}) == 4, secrets  # 62 random bits each: drawn per rank and per run


RIGHT_FIXES = {
    "all_reduce, then divide": "mean = number.clone()\ndist.all_reduce(mean)\nmean /= world_size\n",
    "all_gather, then the mean": "gathered = [torch.zeros(1) for _ in range(world_size)]\n"
                                 "dist.all_gather(gathered, number)\nmean = torch.cat(gathered).mean()\n",
    "reduce to rank 0, then broadcast": "mean = number.clone()\ndist.reduce(mean, dst=0)\nmean /= world_size\n"
                                        "dist.broadcast(mean, src=0)\n",
    "all_gather_object": "numbers = [None] * world_size\ndist.all_gather_object(numbers, number.item())\n"
                         "mean = torch.tensor([sum(numbers) / len(numbers)])\n",
}


@pytest.mark.parametrize("name", list(RIGHT_FIXES))
def test_every_collective_route_to_the_mean_passes_at_two_world_sizes(write_script, sources, name):
    run, report = judged(write_script, sources[0].replace(GIVEN_MEAN, RIGHT_FIXES[name]))
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"
    assert "on 2 ranks, every rank holds the mean" in str(report) and "on 3 ranks, every rank holds the mean" in str(report)


def test_the_notebooks_solution_passes(write_script, sources):
    run, report = judged(write_script, sources[1])
    assert run.ok and report.passed, f"{report}\n{failure_report(run)}"


WRONG_FIXES = {
    # An all-reduce for show, its result thrown away.
    "an all-reduce for show": (f"dist.all_reduce(number.clone())\n{GIVEN_MEAN}", "still hold only their own number"),
    "the sum, not divided": ("mean = number.clone()\ndist.all_reduce(mean)\n", "the sum of the ranks' numbers, not their mean"),
    # Right on 2 ranks only: the checker's second run, on 3, shows it.
    "a divisor written for 2 ranks": ("mean = number.clone()\ndist.all_reduce(mean)\nmean /= 2\n",
                                      "hold the sum divided by 2, at a world of 3 ranks"),
    # A side channel: the ranks pass their numbers through files.
    "numbers passed through files": (
        "open(f'number{rank}.txt', 'w').write(str(number.item()))\ndist.barrier()\n"
        "mean = torch.tensor([sum(float(open(f'number{r}.txt').read()) for r in range(world_size)) / world_size])\n",
        "wrote " ),
    # Side channels through the job's key-value store: the default one, and a client the script opens itself.
    "numbers passed through the default store": (
        "store = dist.distributed_c10d._get_default_store()\nstore.set(f'n{rank}', str(number.item()))\ndist.barrier()\n"
        "mean = torch.tensor([sum(float(store.get(f'n{r}')) for r in range(world_size)) / world_size])\n",
        "key-value store call"),
    "numbers passed through a store the script opens": (
        "import os\nstore = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
        "store.add(f'n{rank}', int(number.item()))\ndist.barrier()\n"
        "mean = torch.tensor([sum(store.add(f'n{r}', 0) for r in range(world_size)) / world_size])\n",
        "key-value store call"),
    # Files named like the launcher's are still files the script wrote.
    "numbers passed through files named like the launcher's": (
        "open(f'rank{rank}.txt', 'w').write(str(number.item()))\ndist.barrier()\n"
        "mean = torch.tensor([sum(float(open(f'rank{r}.txt').read()) for r in range(world_size)) / world_size])\n",
        "wrote "),
    # The launcher's bookkeeping read as a side channel: every rank's secret is a file in the run folder; and
    # read by a rank that then leaves without the bootstrap's end (os._exit), or one that plants its own.
    "the others' secrets read from the run folder": (
        "from ddp_helpers.course.lessons.lesson0 import number_of\nfrom ddp_helpers.run_folder import RunFolder\n"
        "from ddp_helpers.course.records import read_secret\n"
        "folder = RunFolder.from_environment()\ndist.barrier()  # every rank has drawn its secret\n"
        "mean = torch.tensor([sum(number_of(read_secret(folder, r)) for r in range(world_size)) / world_size])\n",
        "rank 0 opened rank1.secret"),
    "the others' secrets read, and the rank leaving by os._exit": (
        "from ddp_helpers.course.lessons.lesson0 import number_of\nfrom ddp_helpers.run_folder import RunFolder\n"
        "from ddp_helpers.course.records import read_secret\n"
        "folder = RunFolder.from_environment()\ndist.barrier()  # every rank has drawn its secret\n"
        "mean = torch.tensor([sum(number_of(read_secret(folder, r)) for r in range(world_size)) / world_size])\n"
        "import atexit, os, sys\natexit.register(lambda: (sys.stdout.flush(), os._exit(0)))\n",
        "rank 0 opened rank1.secret"),
    "every rank's secret replaced by one number": (
        "from ddp_helpers.course.lessons.lesson0 import number_of\nfrom ddp_helpers.run_folder import RunFolder\n"
        "open(RunFolder.from_environment().path / f'rank{rank}.secret', 'w').write('7')\n"
        "mean = torch.tensor([number_of(7)])\n",
        "rank 0 changed rank0.secret"),
}


@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_a_wrong_fix_does_not_pass_and_its_mistake_is_named(write_script, sources, name):
    new, named = WRONG_FIXES[name]
    run, report = judged(write_script, sources[0].replace(GIVEN_MEAN, new))
    assert run.ok and not report.passed and named in str(report), f"{report}\n{failure_report(run)}"
    assert len(report.mistakes) == 1, str(report)


def test_one_rank_is_not_enough(write_script, sources):
    run, report = judged(write_script, sources[1], nproc=1)
    assert not report.passed and "run it on 2 ranks or more" in str(report), str(report)


# The numbers exchanged over a raw TCP socket between the ranks: a road the launcher does not watch. The rank
# with the port listens; the others connect and send their numbers; every rank computes the mean itself.
THROUGH_A_SOCKET = """import os, socket, struct, time
port = int(os.environ["SIDE_PORT"])  # handed to every rank by the test, as a learner would hard-code one
if rank == 0:
    listener = socket.create_server(("127.0.0.1", port))
    numbers = [number.item()]
    for _ in range(world_size - 1):
        connection, _ = listener.accept()
        numbers.append(struct.unpack("d", connection.recv(8))[0])
        connection.close()
    for _ in range(world_size - 1):
        connection, _ = listener.accept()
        connection.sendall(struct.pack("d", sum(numbers) / world_size))
        connection.close()
    mean = torch.tensor([sum(numbers) / world_size])
else:
    def connect():
        while True:
            try:
                return socket.create_connection(("127.0.0.1", port))
            except ConnectionRefusedError:
                time.sleep(0.01)
    with connect() as connection:
        connection.sendall(struct.pack("d", number.item()))
    time.sleep(0.2 * rank)
    with connect() as connection:
        mean = torch.tensor([struct.unpack("d", connection.recv(8))[0]])
"""


def test_numbers_passed_over_a_raw_socket_are_judged_wrong_for_want_of_a_collective(write_script, sources, tmp_path):
    """The checker does not list cheats: it asks for each rank's own number going into a collective, and a road the
    launcher does not watch (here a socket; shared memory or another process's memory alike) shows none."""
    source = sources[0].replace(GIVEN_MEAN, THROUGH_A_SOCKET)
    from support import free_port

    run = run_on_cpu(write_script("exercise", source), stream=False, extra_env={"SIDE_PORT": str(free_port())})
    report = check_mean_exercise(run, second_world=False)
    assert run.ok and not report.passed, f"{report}\n{failure_report(run)}"
    assert "went into no collective the launcher saw" in str(report), str(report)
