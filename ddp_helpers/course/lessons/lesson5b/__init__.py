"""Deep dive 5b, debugging on a cluster: a hang as nccl's watchdog reports it, the flight recorder's dumps read by
torch's analyser, the root cause in plain torchrun's summary (`@record`), a rendezvous that never completes, py-spy,
faulthandler and `torch.distributed.breakpoint`, logs per rank and nccl's own. Its checks are in the notebook; its
code is lesson 5's (`lesson5.frtrace`, `lesson5.py_spy_dump`, ...) and its quiz."""
