"""Lesson 3 (synchronized BatchNorm and sharded state): references the notebook compares runs with,
the same script at other world sizes, and the exercise checker.

The exercise gives a DDP training with Adam that saves its checkpoint from rank 0 with `torch.save`, as lesson 2
taught, and asks for two things the lesson's numbers decide: each rank may hold at most 16/W + 2 bytes per
parameter of the model after its optimizer steps (W ranks: 10 at 2), and the checkpoint must resume at any world
size with no rank ever holding the whole model. DDP holds 16 bytes per parameter on every rank, ZeRO-1 12 or more
at 2 ranks: only sharding everything (FSDP) fits, and once the state is sharded, rank 0's `state_dict` holds only
its pieces. The checker trusts nothing the script says about itself: what each rank's tensors held after every
optimizer step is measured in the rank (`_held_memory`, a global optimizer hook that `my_batch` starts); it finds
what was written (files seen by the launcher, on every rank); reads each DCP folder's metadata to see that no
rank held a whole tensor and each rank wrote its share of the bytes; resumes the checkpoint with the lesson's own
loader (`loader.py`) as jobs of 1 and 4 ranks (3 when it was saved at 4); and compares the model, Adam's moments
and step with the exercise's training done here in one process. Each rank's batches come from its secret
(`my_batch`; `ddp_helpers.rank_secret`), so no rank can train on the global batch itself and leave FSDP's
reduce-scatter only averaging equal gradients; and, the positive evidence, FSDP's reduce-scatters must be seen
carrying each rank's own batch's gradients every step (a fingerprint of their input, `own_gradients_unseen`),
whatever road the other ranks' batches could take besides.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from ...exercises import ExerciseReport, per_share_gradients, opening
from ....recording import rank_secret
from ....result import RunResult
from ...records import records
from ...progress import records_progress

EXERCISE_STEPS = 5
EXERCISE_BATCH = 16  # samples per rank per step
LOADER = Path(__file__).with_name("loader.py")


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
    from .... import run_script
    from ....default_job import detect_hardware

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
    # Wide enough that its parameters, gradients and Adam's state are nearly all a rank's tensors hold.
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def memory_budget(world_size: int) -> float:
    """The exercise's budget, in bytes per parameter of the model each rank may hold after an optimizer step: a
    W-th of the 16 bytes Adam's training holds per parameter, plus 2 for padding, data and the like."""
    return 16 / world_size + 2


def exercise_batch(step: int, secret: int):
    """The batch of step `step` of the rank whose secret is `secret`: (inputs, targets), EXERCISE_BATCH samples."""
    import torch

    generator = torch.Generator().manual_seed((secret + step) % 2**63)
    return torch.randn(EXERCISE_BATCH, 32, generator=generator), torch.randint(0, 10, (EXERCISE_BATCH,), generator=generator)


def my_batch(step: int):
    """In a rank: this rank's own batch of step `step`, from the secret only this rank's process is handed. From
    its first call the launcher also logs a fingerprint of what FSDP hands its reduce-scatters (the sum of the
    squares of their input: `_all_reduce_log.log_sums`), the evidence the checker asks for."""
    from ... import _all_reduce_log, _held_memory

    _all_reduce_log.log_sums = True
    _held_memory.watch()  # what this rank's tensors hold after each optimizer step: the budget's evidence
    return exercise_batch(step, rank_secret())


REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
FINGERPRINT_TOLERANCE = 0.05  # the own gradients' multiple may wander this much (float32, Adam's drift) and no more


def own_gradient_norms(secrets: list[int]) -> tuple[list[list[float]], list[float]]:
    """Per step, per rank, the sum of the squares of every gradient of the rank's own batch's loss, along the
    exercise's training (`exercise_reference`'s); and per step, that of the whole batch's loss's gradients."""
    import torch

    model = exercise_model()
    return per_share_gradients(
        model, torch.optim.Adam(model.parameters(), lr=1e-2),
        lambda step: [exercise_batch(step, secret) for secret in secrets], EXERCISE_STEPS,
        torch.nn.functional.cross_entropy, lambda parameters: sum(float(p.grad.double().square().sum()) for p in parameters))


def own_gradients_unseen(run: RunResult, secrets: list[int]) -> str | None:
    """What shows that FSDP's reduce-scatters did not carry each rank's own batch's gradients, every step; None
    when they did. FSDP hands each reduce-scatter a rank's whole unsharded gradients (a unit's, scaled by one factor
    of its own choosing), so per step the sum of their squares over the step's reduce-scatters is a fixed multiple
    of the squares of the rank's own gradients, the same on every rank and step. Whichever explains the logged
    fingerprints with the steadier multiple, the ranks' own batches' gradients or the whole batch's, is what they
    carried: a comparison float32's rounding (a ReLU flipped now and then) does not tip."""
    own_norms, whole_norms = own_gradient_norms(secrets)
    by_own, by_whole = [], []
    for rank in run.ranks:
        fingerprints = [call.get("sum_of_squares") for call in records(run)[rank.rank].handed_to_collectives
                        if call.get("collective") in REDUCE_SCATTERS]
        if not fingerprints or None in fingerprints or len(fingerprints) % EXERCISE_STEPS:
            return f"rank {rank.rank}'s reduce-scatters were not seen in each of the {EXERCISE_STEPS} steps"
        per_step = len(fingerprints) // EXERCISE_STEPS
        for step in range(EXERCISE_STEPS):
            logged = sum(fingerprints[step * per_step:(step + 1) * per_step])
            by_own.append(logged / own_norms[step][rank.rank])
            by_whole.append(logged / whole_norms[step])
    spread = lambda ratios: (max(ratios) - min(ratios)) / (sum(ratios) / len(ratios))
    if spread(by_whole) < spread(by_own) or spread(by_own) > FINGERPRINT_TOLERANCE:
        return "each rank's reduce-scatters did not carry its own batch's gradients"
    return None


def exercise_reference(secrets: list[int]):
    """The exercise's training in one process, on ranks with these secrets: each step's global batch is every
    rank's batch, and the mean loss over it gives the gradient the ranks' averaged one equals.
    Returns (model, optimizer)."""
    import torch

    model = exercise_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(EXERCISE_STEPS):
        batches = [exercise_batch(step, secret) for secret in secrets]
        inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


@records_progress  # the learner's progress notes whether this run passed
def check_sharded_training_exercise(run: RunResult) -> ExerciseReport:
    """Name what keeps the exercise's training over its memory budget, or its checkpoint from resuming at another
    world size, or confirm it keeps both."""
    report = ExerciseReport(
        verdict_when_passed="All checks pass: each rank held its share of the training's memory, every rank wrote "
                            "its own shards, and the checkpoint resumes at another world size exactly where "
                            "training stopped.")
    in_save = [r.rank for r in run.ranks if "state_dict_saver" in r.stderr]
    if (run.timed_out or not run.ok) and in_save and len(in_save) < len(run.ranks):
        others = [r.rank for r in run.ranks if r.rank not in in_save]
        report.mistakes.append(
            f"rank(s) {in_save} waited in dcp.save for the other ranks, and rank(s) {others} never came: "
            "dcp.save is a collective (the ranks agree on who writes what)"
        )
        return report
    if run.timed_out:
        stuck = [f"rank {r.rank} at line {_last_line(r.stderr)} of the cell" for r in run.ranks if _last_line(r.stderr)]
        report.mistakes.append(
            "the run never finished (" + (", ".join(stuck) or "see the stacks above") + "): a rank waited in a "
            "collective that another rank never called"
        )
        return report
    untrained = _optimizer_without_gradients(run)
    if untrained and not run.ok:  # the error above is where it surfaced (get_state_dict, say), not what caused it
        report.mistakes.append(untrained)
        return report
    secrets = opening(run, report, at_least=2, ranks_for="a budget of a W-th of the memory needs W ranks to share it",
                      files=False)  # the checkpoint's files are the exercise's
    if secrets is None or not _judge_memory(run, report):
        return report
    # What the ranks wrote where the run works (its folder, or --cwd), as the launcher saw it.
    places = {run.run_dir.resolve(), run.config.working_dir.resolve()}
    written = {r.rank: [Path(p) for p in records(run)[r.rank].files_written if any(Path(p).is_relative_to(d) for d in places)]
               for r in run.ranks}
    folders = sorted({p.parent for paths in written.values() for p in paths if p.name == ".metadata"})
    if not folders:
        _judge_plain_files(run, written, report)
        return report
    layouts = _read_layouts(folders, report)
    if layouts is None:
        return report
    if not _judge_sharding(layouts, len(run.ranks), report) or not _judge_nothing_gathered_whole(run, report):
        return report
    _judge_resumed(run, layouts, secrets, report)
    if not report.mistakes:  # the right checkpoint: now the positive evidence that the ranks trained together
        unseen = own_gradients_unseen(run, secrets)
        if unseen:
            report.mistakes.append(f"the checkpoint is right, but {unseen}: the ranks learned each other's batches "
                                   "some other way. What does FSDP's reduce-scatter put together?")
        else:
            report.confirmed.append("every step, FSDP's reduce-scatters carried each rank's own batch's gradients")
    return report


def _measured_steps(run: RunResult, rank: int) -> list[dict]:
    """What `_held_memory` measured after each of the rank's optimizer steps (a failed measurement left out)."""
    return [step for step in records(run)[rank].held_after_steps if "error" not in step]


def _optimizer_without_gradients(run: RunResult) -> str | None:
    """What to say when a rank's optimizer stepped the training's steps without one gradient on its parameters
    (as `_held_memory` measured after each step): it holds tensors the model no longer trains. None otherwise."""
    for r in run.ranks:
        measured = _measured_steps(run, r.rank)[:EXERCISE_STEPS]
        if len(measured) == EXERCISE_STEPS and all(step["gradients"] == 0 for step in measured):
            return (f"rank {r.rank}'s optimizer stepped {EXERCISE_STEPS} times, and its parameters had no gradient "
                    "after any of the steps: Adam never moved them. The tensors it holds are not the ones the "
                    "model's forward and backward use")
    return None


def _judge_memory(run: RunResult, report: ExerciseReport) -> bool:
    """Every rank, after each of the training's optimizer steps, held at most the budget (as `_held_memory` measured
    it in the rank): named with what the worst rank held, parameters, gradients, optimizer state and the rest."""
    parameters = sum(p.numel() for p in exercise_model().parameters())
    world, budget = len(run.ranks), memory_budget(len(run.ranks))
    untrained = _optimizer_without_gradients(run)
    if untrained:
        report.mistakes.append(untrained)
        return False
    worst = None
    for r in run.ranks:
        measured = _measured_steps(run, r.rank)
        if len(measured) < EXERCISE_STEPS:
            report.mistakes.append(
                f"rank {r.rank} made {len(measured)} optimizer step(s) that could be measured, of the training's "
                f"{EXERCISE_STEPS}: train with a torch.optim optimizer's step(), as given")
            return False
        # An optimizer wrapping another (ZeRO-1's) is measured twice a step, the same memory: the inner one's
        # measure names its state.
        heaviest = max(measured, key=lambda step: (sum(step.values()), step["optimizer_state"]))
        if worst is None or sum(heaviest.values()) > sum(worst[1].values()):
            worst = (r.rank, heaviest)
    rank, held = worst
    per_parameter = {part: held.get(part, 0) / parameters for part in ("parameters", "gradients", "optimizer_state", "other")}
    total = sum(per_parameter.values())
    parts = (f"{per_parameter['parameters']:.1f} in parameters, {per_parameter['gradients']:.1f} in gradients, "
             f"{per_parameter['optimizer_state']:.1f} in the optimizer's state, {per_parameter['other']:.1f} in "
             "other tensors")
    if total > budget:
        report.mistakes.append(
            f"after an optimizer step rank {rank} held {total:.1f} bytes per parameter of the model ({parts}, measured "
            f"in the rank): over the budget of {budget:.1f} at {world} ranks (the checkpoint is judged once the "
            "budget is met)")
        return False
    report.confirmed.append(f"after every optimizer step each rank held at most {total:.1f} bytes per parameter of "
                            f"the model ({parts}): within the budget of {budget:.1f} at {world} ranks")
    return True


_FLOAT_DTYPES = {"float", "float32", "half", "float16", "bfloat16", "double", "float64"}


def _judge_nothing_gathered_whole(run: RunResult, report: ExerciseReport) -> bool:
    """No rank gathered (or scattered) whole parameters or optimizer states on the way to sharded files.
    FSDP2 all-gathers and reduce-scatters flat, one-dimensional buffers; `full_tensor()` (a full state dict)
    and `distribute_tensor` move tensors in their own shapes: a float gather or scatter of a tensor with two
    or more dimensions, in torch's flight recorder, is a rank holding a whole tensor."""
    from ....flight_recorder import torch_dtype_name

    for r in run.ranks:
        for entry in records(run)[r.rank].collectives:
            if "gather" not in entry["op"] and "scatter" not in entry["op"]:
                continue
            shaped = [shape for shape, dtype in zip(entry["shapes"], entry["dtypes"])
                      if len(shape) >= 2 and torch_dtype_name(dtype) in _FLOAT_DTYPES]
            if shaped:
                report.mistakes.append(
                    f"rank {r.rank} ran {entry['op']} of a {list(shaped[0])} float tensor (seen by torch's flight "
                    "recorder; FSDP itself only moves flat buffers): whole tensors were gathered on the way to the "
                    "checkpoint. Under FSDP no rank should ever hold the whole model, not even to cut it up again")
                return False
    return True


def _read_layouts(folders: list[Path], report: ExerciseReport) -> dict[Path, object] | None:
    """Each DCP folder's metadata (which piece of which tensor is in which file), or None after a mistake."""
    from torch.distributed.checkpoint import FileSystemReader

    layouts = {}
    for folder in folders:
        try:
            layouts[folder] = FileSystemReader(folder).read_metadata()
        except Exception as error:  # noqa: BLE001 - a torn or foreign folder is the learner's to fix
            report.mistakes.append(f"{folder.name}/ could not be read back ({type(error).__name__}: "
                                   f"{(str(error).splitlines() or [''])[0][:160]})")
            return None
    return layouts


def _judge_sharding(layouts: dict, world_size: int, report: ExerciseReport) -> bool:
    """No rank held the whole model: every tensor that can be split is stored in pieces, and each rank's
    file holds about its share of the tensors' bytes (DCP itself writes a file for every rank, even an
    empty one, so that alone proves nothing)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for folder, layout in layouts.items():
        tensors = {key: meta for key, meta in layout.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
        whole = [key for key, meta in tensors.items() if len(meta.size) and meta.size[0] >= world_size
                 and any(tuple(chunk.sizes) == tuple(meta.size) for chunk in meta.chunks)]
        if whole:
            writer = next((info.relative_path for index, info in layout.storage_data.items() if index.fqn == whole[0]), "?")
            report.mistakes.append(
                f"{folder.name}/ stores {whole[0]} (and {len(whole) - 1} more) whole, written from {writer}: a rank "
                "held the whole tensor when it saved. Under FSDP no rank should ever hold the whole model")
            return False
        per_file: dict[str, int] = {}
        for index, info in layout.storage_data.items():
            if index.fqn in tensors:
                per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
        total = sum(per_file.values()) or 1
        shares = {name: size / total for name, size in sorted(per_file.items())}
        if len(shares) < world_size or max(shares.values()) > 1 / world_size + 0.5 * (1 - 1 / world_size):
            report.mistakes.append(
                f"in {folder.name}/, the tensors' bytes are not spread over the {world_size} ranks' files "
                f"({', '.join(f'{n}: {s:.0%}' for n, s in shares.items())}): some rank held more than its share")
            return False
        report.confirmed.append(
            f"{folder.name}/: every tensor stored in pieces, each rank's file holding its share of the bytes ("
            + ", ".join(f"{s:.0%}" for s in shares.values()) + ")")
    return True


def _find_part(layouts: dict, suffixes: tuple[str, ...]) -> tuple[Path, str, str] | None:
    """(folder, key prefix, which suffix matched) of the first key ending with one of `suffixes`."""
    for folder, layout in layouts.items():
        for key in layout.state_dict_metadata:
            for suffix in suffixes:
                if key == suffix or key.endswith("." + suffix):
                    return folder, key[: len(key) - len(suffix)], suffix
    return None


def resume_worlds(saved_world: int) -> tuple[int, int]:
    """The world sizes the checker resumes at: a single process, and a world other than the saving one."""
    return (1, 3 if saved_world == 4 else 4)


def _judge_resumed(run: RunResult, layouts: dict, secrets: list[int], report: ExerciseReport) -> None:
    """Resume the checkpoint at other world sizes with the lesson's own loader, and compare the model and
    Adam's state with the exercise's training done here in one process."""
    import torch

    from .... import run_script

    model_part = _find_part(layouts, ("0.weight",))
    if model_part is None:
        report.mistakes.append("the checkpoint holds no model state_dict (no parameter such as 0.weight in it)")
        return
    optimizer_part = _find_part(layouts, ("state.0.weight.exp_avg", "state.0.exp_avg"))
    env = {"DDP_LESSONS_MODEL": f"{model_part[0]}|{model_part[1]}"}
    if optimizer_part is not None:
        style = "names" if optimizer_part[2].startswith("state.0.weight") else "numbers"
        env["DDP_LESSONS_OPTIMIZER"] = f"{optimizer_part[0]}|{optimizer_part[1]}|{style}"
    world_size = len(run.ranks)
    reference, reference_optimizer = exercise_reference(secrets)
    for world in resume_worlds(world_size):
        resumed = run_script(LOADER, nproc=world, backend="gloo", stream=False, timeout_s=60, extra_env=env,
                             run_dir=run.run_dir.with_name(f"{run.run_dir.name}-resumed-at-{world}"))
        if not resumed.ok:
            error = resumed.first_failure.error if resumed.first_failure else None
            report.mistakes.append(f"a job of {world} rank(s) could not resume from the checkpoint: "
                                   + (f"{error.type}: {(error.message.splitlines() or [''])[0][:200]}" if error
                                      else resumed.summary()))
            return
        facts = resumed.ranks[0].facts
        wrong = [name for name, p in reference.named_parameters()
                 # Adam's step is about lr (1e-2) whatever the gradient: where summing in another order moves a
                 # gradient that nearly cancels, an element moves by up to ~1e-5 (one in 262,144 here, measured).
                 if not torch.allclose(facts["parameters"][name], p.detach(), rtol=1e-4, atol=1e-4)]
        if wrong:
            report.mistakes.append(
                f"resumed at world {world}, the parameters ({wrong[0]}, ...) are not the model's after its "
                f"{EXERCISE_STEPS} training steps (beyond 1e-4): the checkpoint holds other weights than the training "
                "reached")
            return
        if optimizer_part is None:
            report.mistakes.append("the checkpoint has no optimizer state: a resumed job would start Adam's moments "
                                   "(and its step count) from zero, and train differently")
            return
        if facts["step"] != [float(EXERCISE_STEPS)]:
            report.mistakes.append(f"resumed at world {world}, Adam is at step {facts['step']}, not after the "
                                   f"{EXERCISE_STEPS} steps taken")
            return
        for moment in ("exp_avg", "exp_avg_sq"):
            off = [name for name, p in reference.named_parameters()
                   if not torch.allclose(facts[moment][name], reference_optimizer.state[p][moment], rtol=1e-4, atol=1e-6)]
            if off:
                report.mistakes.append(f"resumed at world {world}, Adam's {moment} for {off[0]} is not the trained "
                                       "model's: some ranks' pieces are missing or from another time")
                return
        report.confirmed.append(
            f"resumed by a job of {world} rank(s) (saved at world {world_size}): the trained model, and Adam's "
            f"moments at step {EXERCISE_STEPS}, {resumed.ranks[0].facts['shard_bytes']:,} parameter bytes per rank")


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
