"""Lesson 3 (synchronized BatchNorm and sharded state): references the notebook compares runs with,
the same script at other world sizes, and the exercise checker.

The exercise trains a model sharded with FSDP2 and must save a checkpoint that a job of any world
size can resume from: the model and Adam's state, every rank writing its own shards. The given
script saves `model.state_dict()` from rank 0, as lesson 2 taught for DDP; under FSDP that file holds
only rank 0's halves. The checker trusts nothing the script says about itself: it finds what was
written (files seen by the launcher, on every rank), loads it in this single process, and compares
it with the same training done here in one process.
"""

from __future__ import annotations

import re
import tempfile
import zipfile
from pathlib import Path

from ..exercises import ExerciseReport
from ..result import RunResult

EXERCISE_STEPS = 5
EXERCISE_BATCH = 16  # samples per rank per step


def exponential_average(batch_means, momentum: float):
    """The running mean BatchNorm keeps when it sees these batch means, one per step, from zero."""
    import torch

    running = torch.zeros_like(batch_means[0])
    history = []
    for mean in batch_means:
        running = running.lerp(mean, momentum)
        history.append(running)
    return torch.stack(history)


def run_at_worlds(run: RunResult, worlds=(1, 2, 4)) -> dict[int, RunResult]:
    """`run`'s script again at each world size (as `torchrun --nproc-per-node W script.py`): {W: result}.
    `run` itself stands for its own world size; each runs in `run`'s working directory. GPUs when there is one for each rank, else CPU processes:
    the bytes each rank holds do not depend on the device."""
    from .. import run_script
    from ..config import detect_hardware

    gpus = detect_hardware().gpu_count
    results = {len(run.ranks): run}
    for world in worlds:
        if world not in results:
            backend = "nccl" if run.backend == "nccl" and world <= gpus else "gloo"
            results[world] = run_script(run.config.script, nproc=world, backend=backend, cwd=run.config.cwd,
                                        stream=False).raise_for_failure()
    return {world: results[world] for world in sorted(results)}


def exercise_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def exercise_reference(world_size: int):
    """The exercise's training in one process: each step's global batch is every rank's batch, and the
    mean loss over it gives the gradient the ranks' averaged one equals. Returns (model, optimizer)."""
    import torch

    model = exercise_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generators = [torch.Generator().manual_seed(rank) for rank in range(world_size)]
    for _ in range(EXERCISE_STEPS):
        batches = [(torch.randn(EXERCISE_BATCH, 32, generator=g), torch.randint(0, 10, (EXERCISE_BATCH,), generator=g))
                   for g in generators]
        inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def check_checkpoint_exercise(run: RunResult) -> ExerciseReport:
    """Name what keeps the exercise's checkpoint from resuming at another world size, or confirm it does."""
    report = ExerciseReport(
        verdict_when_passed="All checks pass: every rank wrote its own shards, and the checkpoint resumes "
                            "at another world size exactly where training stopped.")
    in_save = [r.rank for r in run.ranks if "state_dict_saver" in r.stderr]
    if (run.timed_out or not run.ok) and in_save and len(in_save) < len(run.ranks):
        others = [r.rank for r in run.ranks if r.rank not in in_save]
        report.mistakes.append(
            f"rank(s) {in_save} waited in dcp.save for the other ranks, and rank(s) {others} never came: "
            "dcp.save is a collective (the ranks agree on who writes what)"
        )
        return report
    if run.timed_out:
        stuck = [f"rank {r.rank} at line {_last_line(r.stderr)}" for r in run.ranks if _last_line(r.stderr)]
        report.mistakes.append(
            "the run never finished (" + (", ".join(stuck) or "see the stacks above") + "): a rank waited in a "
            "collective that another rank never called"
        )
        return report
    if not run.ok:
        report.mistakes.append("the run failed; fix the error shown above first")
        return report
    # What the ranks wrote where the run works (its folder, or --cwd), as the launcher saw it.
    places = {run.run_dir.resolve(), run.config.working_dir.resolve()}
    written = {r.rank: [Path(p) for p in r.files_written if any(Path(p).is_relative_to(d) for d in places)]
               for r in run.ranks}
    folders = sorted({p.parent for paths in written.values() for p in paths if p.name == ".metadata"})
    if not folders:
        _judge_plain_files(run, written, report)
        return report
    for folder in folders:
        shards = {rank for rank, paths in written.items() for p in paths if p.parent == folder and p.suffix == ".distcp"}
        missing = sorted(set(range(len(run.ranks))) - shards)
        if missing:
            report.mistakes.append(f"ranks {missing} wrote no shard of {folder.name}/: each rank should write its own")
            return report
    names = ", ".join(f"{folder.name}/" for folder in folders)
    report.confirmed.append(f"every rank wrote its own shard of {names} (seen by the launcher), rank 0 the metadata too")
    _judge_contents(folders, len(run.ranks), report)
    return report


def _last_line(stderr: str) -> str | None:
    lines = re.findall(r'exercise\.py", line (\d+)', stderr)
    return lines[-1] if lines else None


def _judge_plain_files(run: RunResult, written: dict, report: ExerciseReport) -> None:
    """No DCP checkpoint: say what the files that were written are, and why they do not resume elsewhere."""
    import torch

    files = {rank: [p for p in paths if p.suffix in (".pt", ".pth") and p.is_file()] for rank, paths in written.items()}
    writers = [rank for rank, paths in files.items() if paths]
    if not writers:
        report.mistakes.append("no checkpoint was written: the trained model and optimizer are lost when the job ends")
        return
    if len(writers) > 1:
        report.mistakes.append(
            f"ranks {writers} each wrote their own file: nothing records which piece of which tensor each file "
            f"holds, so only a job of {len(run.ranks)} ranks sharded exactly the same way could read them back"
        )
        return
    path = files[writers[0]][-1]
    if _pickles_dtensors(path):
        report.mistakes.append(
            f"{path.name}, written by rank {writers[0]} alone, holds sharded tensors (DTensors): under FSDP each "
            "rank's state_dict has only its own piece of every parameter, so the other ranks' pieces are not in it"
        )
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a torn or foreign file is the learner's to fix
        report.mistakes.append(f"{path.name} could not be loaded ({type(error).__name__})")
        return
    report.mistakes.append(
        f"rank {writers[0]} gathered the whole model into {path.name}: it resumes, but only while one rank "
        "can hold everything, which is what sharding is for avoiding. Every rank should write its own shards"
    )


def _pickles_dtensors(path: Path) -> bool:
    """Whether a torch.save file refers to DTensor, read without unpickling it."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(b"DTensor" in archive.read(name) for name in archive.namelist() if name.endswith(".pkl"))
    except (OSError, zipfile.BadZipFile):
        return False


def _find(value, wanted):
    """The first dict in `value` (depth first) for which wanted(dict) holds, or None."""
    if isinstance(value, dict):
        if wanted(value):
            return value
        for item in value.values():
            found = _find(item, wanted)
            if found is not None:
                return found
    return None


def _judge_contents(folders: list[Path], world_size: int, report: ExerciseReport) -> None:
    """Load the checkpoint (one DCP folder, or several: say the model and the optimizer apart) here, in one
    process, and compare it with the same training done here."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {}
    with tempfile.TemporaryDirectory() as scratch:
        for number, folder in enumerate(folders):
            try:
                dcp_to_torch_save(folder, Path(scratch) / f"{number}.pt")
                # DCP's metadata is pickled: this loads only the learner's own checkpoint, written by this run.
                state[str(number)] = torch.load(Path(scratch) / f"{number}.pt", map_location="cpu", weights_only=False)
            except Exception as error:  # noqa: BLE001
                report.mistakes.append(f"{folder.name}/ could not be read back ({type(error).__name__}: "
                                       f"{(str(error).splitlines() or [''])[0][:160]})")
                return
    where = ", ".join(f"{folder.name}/" for folder in folders)
    reference, reference_optimizer = exercise_reference(world_size)
    expected = reference.state_dict()
    model_state = _find(state, lambda d: set(expected) <= set(d))
    if model_state is None:
        report.mistakes.append(f"{where} holds no model state_dict (with keys {sorted(expected)})")
    else:
        loaded = {name: model_state[name] for name in expected}
        wrong = [n for n in expected if loaded[n].shape != expected[n].shape
                 or not torch.allclose(loaded[n], expected[n], rtol=1e-4, atol=1e-5)]
        if wrong:
            report.mistakes.append(
                f"the saved parameters ({wrong[0]}, ...) are not the model's after its {EXERCISE_STEPS} training "
                "steps: save once training is done"
            )
        else:
            report.confirmed.append(f"loaded in one process (world 1, saved at world {world_size}), the model "
                                    f"equals the trained one")
    optimizer_state = _find(state, lambda d: "state" in d and "param_groups" in d)
    if optimizer_state is None or not optimizer_state["state"]:
        report.mistakes.append("the checkpoint has no optimizer state: a resumed job would start Adam's moments "
                               "(and its step count) from zero, and train differently")
        return
    names = [name for name, _ in reference.named_parameters()]
    expected_state = {name: reference_optimizer.state[p] for name, p in reference.named_parameters()}
    # get_state_dict names each parameter's state by its name; optimizer.state_dict() by its position
    # (which DCP stores as a string).
    saved = {(names[int(key)] if str(key).isdigit() and int(key) < len(names) else key): value
             for key, value in optimizer_state["state"].items()}
    steps = sorted({float(s["step"]) for s in saved.values() if "step" in s})
    if steps != [float(EXERCISE_STEPS)]:
        report.mistakes.append(f"the optimizer state is at step {steps}, not after the {EXERCISE_STEPS} steps taken")
        return
    for name, state_expected in expected_state.items():
        moment = saved.get(name, {}).get("exp_avg")
        if moment is None or moment.shape != state_expected["exp_avg"].shape:
            report.mistakes.append(f"Adam's moments for {name} are missing or only a piece: some ranks' shards "
                                   "are not in the checkpoint")
            return
        if not torch.allclose(moment, state_expected["exp_avg"], rtol=1e-4, atol=1e-6):
            report.mistakes.append(f"Adam's moments for {name} are not those of the trained model")
            return
    report.confirmed.append(f"Adam's moments are whole and at step {EXERCISE_STEPS}: training resumes where it stopped")
