"""Lesson 3: the exercise checker names the script's first mistake as given (over its memory budget, measured in
the ranks), passes the solution shown (hidden) in the notebook and other right routes, and refuses wrong fixes
for what the ranks did, held and wrote (ZeRO-1 over the budget; the optimizer built before fully_shard; every
wrong checkpoint); the collective counter behind the lesson's communication evidence counts calls and bytes
exactly. The scripts are taken from the notebook itself."""


import re

import pytest

from ddp_helpers.course.lessons.lesson3 import check_sharded_training_exercise
from support import exercise_cells, failure_report, run_on_cpu

NOTEBOOK = "03_syncbn_and_sharded_state.ipynb"
GIVEN_SAVE = """if rank == 0:
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, "checkpoint.pt")
dist.destroy_process_group()
"""
DDP_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP\n"
DDP_LINE = 'model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n'


def exercise_sources() -> tuple[str, str, str]:
    """(the exercise as given, the exercise with the solution's three changes, the solution's save lines)."""
    _, given, (imports, sharding, save) = exercise_cells(NOTEBOOK)
    given += "\n"
    assert given.endswith(GIVEN_SAVE) and DDP_IMPORT in given and DDP_LINE in given
    return given, given.replace(DDP_IMPORT, imports).replace(DDP_LINE, sharding).replace(GIVEN_SAVE, save), save


GIVEN, SOLUTION, SOLUTION_SAVE = exercise_sources()
# Sharded as the solution is, saved as given (rank 0's torch.save, now of its own pieces): where many learners
# will be after the first half of the fix.
TORCH_SAVE = GIVEN_SAVE.replace("model.module.state_dict()", "model.state_dict()")
SOURCES = (SOLUTION.replace(SOLUTION_SAVE, TORCH_SAVE), SOLUTION)
WRONG_FIXES = {
    # ZeRO-1 (the optimizer's state sharded, DDP's gradients and parameters whole): 4 + 4 + 8/2 or more, over 10.
    "ZeRO-1": (GIVEN.replace("optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)",
                             "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
                             "optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)").replace(
                                 "if rank == 0:\n    torch.save(", "optimizer.consolidate_state_dict(to=0)\nif rank == 0:\n    torch.save("),
               "over the budget of 10.0 at 2 ranks"),
    # FSDP with the optimizer built before fully_shard: it holds the parameters fully_shard replaced.
    "the optimizer built before fully_shard": (
        SOLUTION.replace("optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\n", "").replace(
            "mesh = init_device_mesh(", "optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\nmesh = init_device_mesh("),
        "its parameters had no gradient after any of the steps"),
    "dcp.save on rank 0 only": (
        SOURCES[1].replace("model_state, optimizer_state = get_state_dict(model, optimizer)\ndcp.save",
                           "if rank == 0:\n    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save"),
        "waited in dcp.save for the other ranks, and rank(s) [1] never came"),
    "every rank its own torch.save file": (
        SOURCES[0].replace('if rank == 0:\n    torch.save(', 'if True:\n    torch.save(').replace(
            '"checkpoint.pt"', 'f"checkpoint{rank}.pt"'),
        "ranks [0, 1] each wrote their own file"),
    "rank 0 gathers the whole model": (
        SOURCES[0].replace(TORCH_SAVE, """from torch.distributed.checkpoint.state_dict import StateDictOptions
full_model, full_optimizer = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save({"model": full_model, "optimizer": full_optimizer}, "checkpoint.pt")
dist.destroy_process_group()
"""),
        "rank 0 gathered the whole model into checkpoint.pt"),
    "every rank saves the whole (full) state dict with dcp": (
        SOURCES[1].replace("model_state, optimizer_state = get_state_dict(model, optimizer)",
                           "from torch.distributed.checkpoint.state_dict import StateDictOptions\n"
                           "model_state, optimizer_state = get_state_dict(model, optimizer, "
                           "options=StateDictOptions(full_state_dict=True))"),
        "a rank held the whole tensor when it saved"),
    # Every rank holds the whole model and Adam's state, then cuts them up again: the files look sharded.
    "every rank gathers the whole state, then re-shards it for dcp.save": (
        SOURCES[0].replace(TORCH_SAVE, """from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import Shard, distribute_tensor
full_model, full_optimizer = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
reshard = lambda t: distribute_tensor(t.detach(), mesh, [Shard(0)]) if torch.is_tensor(t) and t.dim() > 0 else t
full_model = {k: reshard(v) for k, v in full_model.items()}
full_optimizer["state"] = {k: {n: reshard(v) for n, v in s.items()} for k, s in full_optimizer["state"].items()}
dcp.save({"model": full_model, "optimizer": full_optimizer}, checkpoint_id="checkpoint")
dist.destroy_process_group()
"""),
        "whole tensors were gathered on the way to the checkpoint"),
    # Every rank trains on the global batch (the ranks' secrets passed through the store): FSDP's
    # reduce-scatter then only averages equal gradients.
    "every rank trains on the global batch, secrets through the store": (
        SOURCES[1].replace(
            "    inputs, targets = my_batch(step)  # this rank's own batch, from a secret only its process is handed\n",
            "    from ddp_helpers import rank_secret\n"
            "    from ddp_helpers.course.lessons.lesson3 import exercise_batch\n"
            "    store = dist.distributed_c10d._get_default_store()\n"
            "    store.set(f'secret{rank}', str(rank_secret()))\n"
            "    shares = [exercise_batch(step, int(store.get(f'secret{r}'))) for r in range(world_size)]\n"
            "    inputs, targets = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])\n"),
        "key-value store calls"),
    "the model without the optimizer": (
        SOURCES[1].replace('{"model": model_state, "optimizer": optimizer_state}', '{"model": model_state}'),
        "the checkpoint has no optimizer state"),
    "saved before training": (
        SOURCES[0].replace(TORCH_SAVE, "dist.destroy_process_group()\n").replace(
            "for step in range(5):",
            'dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))), checkpoint_id="checkpoint")\n'
            "for step in range(5):"),
        "are not the model's after its 5 training steps"),
}


def test_the_given_script_has_its_first_mistake_named_without_the_fix(write_script):
    run = run_on_cpu(write_script("exercise", GIVEN), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    text = str(report)
    assert not report.passed and len(report.mistakes) == 1, text
    # DDP and Adam: 4 + 4 + 8 bytes per parameter on every rank, measured in the rank.
    assert re.search(r"rank \d held 16\.\d bytes per parameter of the model \(4\.0 in parameters, 4\.0 in gradients, "
                     r"8\.0 in the optimizer's state", text) and "over the budget of 10.0 at 2 ranks" in text, text
    assert not any(word in text for word in ("FSDP", "fully_shard", "ZeRO", "dcp", "get_state_dict")), \
        "hints must not give the fix"


def test_sharded_but_saved_as_given_names_the_checkpoint(write_script):
    run = run_on_cpu(write_script("exercise", SOURCES[0]), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    text = str(report)
    assert not report.passed and "within the budget of 10.0 at 2 ranks" in text
    assert "checkpoint.pt, written by rank 0 alone, holds sharded tensors (DTensors)" in text
    assert "dcp" not in text and "get_state_dict" not in text, "hints must not give the fix"


def test_the_solution_passes(write_script):
    run = run_on_cpu(write_script("exercise", SOLUTION), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert report.passed, str(report)
    text = str(report)
    assert re.search(r"each rank held at most 8\.\d bytes per parameter", text), text
    assert "checkpoint/: every tensor stored in pieces" in text, text
    assert "resumed by a job of 1 rank(s)" in text and "resumed by a job of 4 rank(s)" in text, text


@pytest.mark.parametrize("wrong_fix", list(WRONG_FIXES))
def test_a_wrong_fix_does_not_pass(write_script, wrong_fix):
    source, named = WRONG_FIXES[wrong_fix]
    assert source not in SOURCES, "the wrong fix must change the script"
    run = run_on_cpu(write_script("exercise", source), nproc=2, stream=False, timeout_s=90)
    report = check_sharded_training_exercise(run)
    assert not report.passed, failure_report(run)
    assert named in str(report), str(report) + "\n" + failure_report(run)


def test_collectives_are_counted_with_their_bytes(write_script):
    script = write_script("count", """
        import torch
        import torch.distributed as dist
        from ddp_helpers import record
        from ddp_helpers.course.comm import bytes_received_per_rank, count_collectives

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        with count_collectives() as comm:
            dist.all_reduce(torch.ones(100))                                   # 400 bytes
            dist.all_reduce(torch.ones(10, dtype=torch.float64))               # 80
            whole = torch.empty(6 * world)
            dist.all_gather_into_tensor(whole, torch.ones(6))                  # the whole: 24 * world
            dist.broadcast(torch.ones(3), src=0)                               # 12
            torch.ones(5) + 1                                                  # not a collective
        record("summary", comm.summary())
        record("received", bytes_received_per_rank(comm.summary(), world))
        pair = dist.new_group([0, 1])  # a sub-group, as FSDP's reshard_after_forward=2 makes at world 4
        with count_collectives() as in_pair:
            if dist.get_rank() in (0, 1):
                dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=pair)
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
        record("group_sizes", [dict(comm.group_sizes), dict(in_pair.group_sizes)])
        dist.destroy_process_group()
    """)
    run = run_on_cpu(script, nproc=3, stream=False)
    assert run.ok, failure_report(run)
    assert run.ranks[1].facts["summary"] == {
        "all_reduce": {"calls": 2, "bytes": 480}, "all_gather": {"calls": 1, "bytes": 72},
        "broadcast": {"calls": 1, "bytes": 12}}
    assert run.ranks[1].facts["received"] == pytest.approx({"all_reduce": 640.0, "all_gather": 48.0, "broadcast": 8.0})
    # The world's all-gather; then the pair's all-gather and the world's reduce-scatter.
    assert run.ranks[1].facts["group_sizes"] == [{"all_gather": [3]}, {"all_gather": [2], "reduce_scatter": [3]}]


def test_optimizer_state_dict_saved_with_dcp_passes(write_script):
    # optimizer.state_dict() under FSDP2 holds this rank's pieces (DTensors), keyed by position: as good.
    numbered = SOURCES[0].replace(TORCH_SAVE, """dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
         checkpoint_id="checkpoint")
dist.destroy_process_group()
""")
    run = run_on_cpu(write_script("exercise", numbered), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert report.passed, str(report)


def test_the_optimizer_built_before_fully_shard_is_named_when_the_run_ends_well_too(write_script):
    # Saved as given (no get_state_dict to fail on the stale optimizer): the run ends well, and trained nothing.
    source = WRONG_FIXES["the optimizer built before fully_shard"][0].replace(SOLUTION_SAVE, TORCH_SAVE)
    run = run_on_cpu(write_script("exercise", source), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert len(report.mistakes) == 1 and "its parameters had no gradient after any of the steps" in report.mistakes[0], \
        str(report)


def test_the_whole_model_sharded_as_one_unit_passes(write_script):
    # One fully_shard on the root: every parameter still sharded, one all-gather and one reduce-scatter a step.
    whole = SOLUTION.replace("for layer in model:\n    if isinstance(layer, torch.nn.Linear):\n        fully_shard(layer, mesh=mesh)\n", "")
    assert whole != SOLUTION
    run = run_on_cpu(write_script("exercise", whole), nproc=2, stream=False)
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert report.passed, str(report)


def test_other_correct_saves_pass_too(write_script, tmp_path):
    # The model and the optimizer in two DCP folders, written where the learner chose to work (--cwd).
    apart = SOURCES[0].replace(TORCH_SAVE, """model_state, optimizer_state = get_state_dict(model, optimizer)
dcp.save(model_state, checkpoint_id="model")
dcp.save(optimizer_state, checkpoint_id="optimizer")
dist.destroy_process_group()
""")
    (tmp_path / "work").mkdir()
    run = run_on_cpu(write_script("exercise", apart), nproc=2, stream=False, cwd=tmp_path / "work")
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert report.passed, str(report)


def test_the_global_batch_learned_over_a_raw_socket_is_judged_wrong_for_want_of_evidence(write_script):
    """The store route above is named as a side channel; a raw socket, which the launcher does not watch, is caught
    by what it lacks: FSDP's reduce-scatters carried the global batch's gradients, not each rank's own."""
    from support import SOCKET_EXCHANGE, free_port

    source = SOCKET_EXCHANGE + SOURCES[1].replace(
        "for step in range(5):",
        "from ddp_helpers import rank_secret\n"
        "from ddp_helpers.course.lessons.lesson3 import exercise_batch\n"
        "secrets = exchanged(rank_secret())\n"
        "my_batch(0)  # as the honest script does first\n"
        "for step in range(5):").replace(
        "    inputs, targets = my_batch(step)  # this rank's own batch, from a secret only its process is handed\n",
        "    shares = [exercise_batch(step, secret) for secret in secrets]\n"
        "    inputs, targets = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])\n")
    run = run_on_cpu(write_script("exercise", source), nproc=2, stream=False, timeout_s=90,
                     extra_env={"SIDE_PORT": str(free_port())})
    assert run.ok, failure_report(run)
    report = check_sharded_training_exercise(run)
    assert len(report.mistakes) == 1 and "did not carry its own batch's gradients" in report.mistakes[0], \
        str(report) + "\n" + failure_report(run)
