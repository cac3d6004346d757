"""``SyncBatchNorm`` for :mod:`hvd_sparse.mpi`: batch statistics over every rank's batch.

Horovod's ``hvd.SyncBatchNorm`` needs Horovod, and its statistics kernels are CUDA's. This one
is written in ordinary differentiable torch operations around two small ``Sum`` allreduces
(the per-channel sums and counts, then the per-channel sums of squared deviations from the
global mean: centred, so as stable as a one-rank batch norm), so it runs on the CPU and on GPUs
alike, and autograd gives each rank the gradient of the sum of every rank's loss, as PyTorch's
and Horovod's do. In evaluation, or on one rank, it is the plain batch norm.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics span all ranks (Horovod's
    signature; any input of at least two dimensions, channels second)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        from . import mpi

        self._check_input_dim(input)
        if not self.training or mpi.size() == 1:
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        local = torch.cat([x.sum(dims), x.new_full((1,), float(input.numel() // channels))])
        total = mpi.allreduce(local, op=mpi.Sum, name="sync_batch_norm.sum")
        count = total[channels]
        mean = total[:channels] / count
        centred = x - mean.view(shape)
        square = mpi.allreduce((centred * centred).sum(dims), op=mpi.Sum,
                               name="sync_batch_norm.var")
        var = square / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                n = float(count)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                         alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                        alpha=factor)
        return y.to(input.dtype)
