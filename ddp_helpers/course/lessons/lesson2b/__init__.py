"""Deep dive 2b, DDP in practice: what every DDP job meets after the nine steps of lesson 2 (accumulation and
buckets, mixed precision, evaluation, data-loading workers, `torch.compile`, unused parameters, uneven inputs, two
traps) and the nine steps in one training script. Its checks are in the notebook; its code here is a plot and its quiz."""
