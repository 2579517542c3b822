"""The backward of lesson 3's hand-built SyncBatchNorm (CPU ranks), kept out of the lesson's main cell:
the lesson's optional part, "Inside SyncBatchNorm's backward", shows and explains it. Imported in ranks:
torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sync_batchnorm_backward(ctx, grad_out, _grad_mean, _grad_var):
    """The input, weight and bias gradients of batch normalisation over every rank's samples.

    The input gradient of each sample depends on every sample of the global batch through two sums,
    Σdy and Σdy·x̂ per channel: one all_reduce of both gives each rank the global batch's."""
    x_hat, weight, invstd, total = ctx.saved_tensors
    channels = x_hat.shape[1]
    sums = torch.cat([grad_out.sum(0), (grad_out * x_hat).sum(0)])
    dist.all_reduce(sums)  # <- [sum dy, sum dy·x̂] over the global batch
    sum_dy, sum_dy_xhat = sums[:channels], sums[channels:]
    grad_x = weight * invstd * (grad_out - sum_dy / total - x_hat * sum_dy_xhat / total)
    # This rank's share of the weight and bias gradients: summed over the ranks, the global batch's.
    return grad_x, (grad_out * x_hat).sum(0), grad_out.sum(0), None
