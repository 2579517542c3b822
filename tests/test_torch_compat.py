"""ddp_helpers/torch_compat.py: what lesson 0 says of the learner's torch, and the one place where the lessons'
code differs between the torch versions the course runs on."""

import inspect

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_helpers import torch_compat
from ddp_helpers.course.records import records


@pytest.mark.parametrize("version, says", [
    ("2.13.0+cpu", "inside the course's range"),
    ("2.11.0+cu130", "inside the course's range"),
    ("2.15.0", "newer than the course's range"),
    ("2.7.1", "older than the course's range"),
])
def test_lesson_0_says_where_a_torch_stands(version, says):
    text = torch_compat.report(version)
    assert text.startswith(f"PyTorch {version}: {says}"), text
    skipped = "No section of the lessons is skipped with this torch." in text
    assert skipped == torch_compat.in_checked_range(version) or torch_compat.release(version) > torch_compat.NEWEST_CHECKED


def test_below_the_range_it_names_what_is_missing():
    lowest = torch_compat.LOWEST
    below = f"{lowest[0]}.{lowest[1] - 1}.0"
    missing = [f for f in torch_compat.FEATURES if not torch_compat.has(f, below)]
    text = torch_compat.report(below)
    assert missing and all(f"Missing with this torch: {f.sections}" in text for f in missing), text


def test_the_installed_torch_is_named_as_torch_names_itself():
    assert torch_compat.torch_version() == torch.__version__  # torch is imported here: its own name, build included


def test_without_torch_imported_the_installed_version_is_read_from_its_metadata():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys; from ddp_helpers import torch_compat; "
                           "print(torch_compat.torch_version(), 'torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    version, imported = done.stdout.split()
    assert torch_compat.release(version) == torch_compat.release(torch.__version__) and imported == "False", done


def test_the_sync_buffers_keyword_is_one_this_torchs_ddp_takes():
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    assert torch_compat.DDP_SYNC_BUFFERS in parameters


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13", "2.14.0.dev20261101"])
def test_a_version_string_is_read_as_its_release(version):
    assert torch_compat.release(version)[0] == 2


def test_a_string_that_is_no_version_is_refused():
    with pytest.raises(ValueError, match="not a torch version"):
        torch_compat.release("nightly")


def test_gloo_prints_its_connections_exactly_where_lesson_0_says(write_script):
    from support import run_on_cpu

    script = write_script("connect", "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                     "dist.barrier()\ndist.destroy_process_group()\n")
    run = run_on_cpu(script, stream=False)
    assert run.ok
    printed = [line for r in run.ranks for line in r.stdout.splitlines(keepends=True)
               if torch_compat.GLOO_CONNECTION_LINE.match(line)]
    expected = torch_compat.release(torch.__version__) <= torch_compat.GLOO_PRINTS_ITS_CONNECTIONS_UP_TO
    assert bool(printed) == expected, [r.stdout for r in run.ranks]
    assert ("[Gloo] Rank N is connected" in torch_compat.report()) == expected


def test_the_flight_recorder_records_a_ranks_collectives_whatever_the_torch(write_script):
    # torch 2.10's keeps nothing unless told to; the hang report and the checkers read what it keeps.
    from support import run_on_cpu

    script = write_script("recorded", "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                      "dist.all_reduce(torch.ones(2))\ndist.all_reduce(torch.ones(3))\n"
                                      "dist.destroy_process_group()\n")
    run = run_on_cpu(script, stream=False)
    assert run.ok
    assert [[c["op"] for c in r.collectives] for r in records(run)] == [["all_reduce", "all_reduce"]] * 2, \
        [r.collectives for r in records(run)]
