"""Deep dive 6b, a step in torch's profiler and the input pipeline: a DDP step traced with `torch.profiler` and
read as data, and each step's wait for its batch with 0, 2 and 8 loader workers. Its checks are in the notebook; its
code is lesson 6's (`lesson6.trace`, `lesson6.plots`) and its quiz."""
