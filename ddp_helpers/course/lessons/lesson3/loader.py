"""Lesson 3's exercise checker resumes the learner's checkpoint with this script, as a job of another world
size would: the exercise's model sharded with FSDP2 for *this* world, Adam, then `dcp.load` of the
checkpoint's pieces this rank needs (the lesson's own loading recipe: `get_state_dict`, `dcp.load`,
`set_state_dict`). It records the whole parameters, Adam's moments and step for the checker.

Where each part is comes from the environment (set by `check_sharded_training_exercise`):
    DDP_LESSONS_MODEL       FOLDER|PREFIX   the DCP folder holding the model, and the key prefix before
                                            its parameter names ("model." for {"model": ...}, or "")
    DDP_LESSONS_OPTIMIZER   FOLDER|PREFIX|STYLE   likewise for the optimizer (absent: none saved); STYLE is
                                            "names" (get_state_dict) or "numbers" (optimizer.state_dict())
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddp_helpers import record

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank, world_size = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world_size,))
torch.manual_seed(1234)  # any weights: every one of them must come from the checkpoint
model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


def nested(prefix: str, value: dict) -> dict:
    """{"a": {"b": value}} for the prefix "a.b.": DCP flattens nested dicts with dots."""
    for part in reversed([p for p in prefix.split(".") if p]):
        value = {part: value}
    return value


def pick(value: dict, prefix: str) -> dict:
    for part in [p for p in prefix.split(".") if p]:
        value = value[part]
    return value


model_state, optimizer_state = get_state_dict(model, optimizer)  # also creates Adam's state to load into
model_folder, model_prefix = os.environ["DDP_LESSONS_MODEL"].split("|")
loaded = nested(model_prefix, model_state)
dcp.load(loaded, checkpoint_id=model_folder)
set_model_state_dict(model, pick(loaded, model_prefix))
if os.environ.get("DDP_LESSONS_OPTIMIZER"):
    folder, prefix, style = os.environ["DDP_LESSONS_OPTIMIZER"].split("|")
    if style == "numbers":  # optimizer.state_dict() was saved: its own keys (parameters by position)
        optimizer_state = optimizer.state_dict()
    loaded = nested(prefix, optimizer_state)
    dcp.load(loaded, checkpoint_id=folder)
    if style == "numbers":
        optimizer.load_state_dict(pick(loaded, prefix))
    else:
        set_optimizer_state_dict(model, optimizer, pick(loaded, prefix))

record("parameters", {name: p.full_tensor() for name, p in model.named_parameters()})
if os.environ.get("DDP_LESSONS_OPTIMIZER"):
    state = {name: optimizer.state[p] for name, p in model.named_parameters()}
    record("exp_avg", {name: s["exp_avg"].full_tensor() for name, s in state.items()})
    record("exp_avg_sq", {name: s["exp_avg_sq"].full_tensor() for name, s in state.items()})
    record("step", sorted({float(s["step"]) for s in state.values()}))
record("shard_bytes", sum(p.to_local().nbytes for p in model.parameters()))
print(f"rank {rank} of {world_size}: resumed from the checkpoint")
dist.destroy_process_group()
