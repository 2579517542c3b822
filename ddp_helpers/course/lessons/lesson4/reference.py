"""Lesson 4's exercise, as given (model, data, seeds, training), run without a kill: the reference the
exercise checker compares a killed-and-restarted run with. It is the checker's own copy, so a "fix" that
changes the model, the data or the randomness of the learner's script does not change the reference.

Run by `check_resume_exercise` under torchrun at the learner's world size and backend, each rank's noise seeded
with the secret of the learner's rank of the same number (DDP_LESSONS_NOISE_SEEDS, comma-separated); it writes
snapshot.pt (model, optimizer, step, and every rank's noise generator as it ended) in its working directory and prints "step N done" after each step.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():  # a gloo launch hides the GPUs: CPU ranks
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=30))
rank, world_size = dist.get_rank(), dist.get_world_size()

generator = torch.Generator().manual_seed(1)
samples = 48 * world_size  # as the exercise: 8 batches of 6 per rank and epoch
dataset = TensorDataset(torch.randn(samples, 6, generator=generator), torch.randn(samples, 1, generator=generator))
sampler = DistributedSampler(dataset, seed=1)
loader = DataLoader(dataset, batch_size=6, sampler=sampler, generator=torch.Generator().manual_seed(1))
# Each rank its own input noise, from the secret the learner's rank of the same number was handed.
noise = torch.Generator().manual_seed(int(os.environ["DDP_LESSONS_NOISE_SEEDS"].split(",")[rank]))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.ReLU(), torch.nn.Linear(24, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
typical_norm = 1.0
model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

step = 0
for epoch in range(3):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        inputs = inputs + 0.1 * torch.randn(inputs.shape, generator=noise)
        loss = torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=typical_norm)
        typical_norm = 0.9 * typical_norm + 0.1 * norm.item()
        optimizer.step()
        print(f"step {step} done")
        step += 1
noise_states = [None] * world_size  # where each rank's noise generator ended: the checker's hints read them
dist.all_gather_object(noise_states, noise.get_state())
if rank == 0:
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step - 1,
                "noise": noise_states}, "snapshot.pt")
dist.barrier()
dist.destroy_process_group()
