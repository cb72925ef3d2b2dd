"""BatchNorm2d over a spatially partitioned sample (section III-B).

The paper leaves open whether batch statistics should be tile-local or aggregated over the spatial
distribution of a sample; both are offered.  ``mode="aggregated"`` (the default) allreduces, per channel, the
sum and the sum of squares over the spatial group in one message (accumulated in float64 so the
``E[x^2] - E[x]^2`` form loses nothing at fp32 tolerance), so the normalisation, the gradients and the running
statistics (unbiased variance over the whole N x H x W) equal those of the unpartitioned layer on the same
samples.  Backward allreduces the two per-channel sums of the input gradient (the adjoint of the statistics'
allreduce); weight and bias gradients stay tile-local partial sums, summed over the group by the strategy.  ``mode="local"`` keeps plain ``nn.BatchNorm2d`` on each tile (cheaper, not equal to the serial
layer).  In eval mode the running statistics are used and nothing is communicated.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.strategies.spatial.layer import SpatialLayer
from lightning_hpc.strategies.spatial.tiling import SpatialGrid

__all__ = ["SpatialBatchNorm2d", "BN_MODES"]

BN_MODES = ("aggregated", "local")


class _AggregatedBatchNorm(torch.autograd.Function):
    """Batch norm whose statistics cover the whole spatial group; saves only the input (like the native layer)
    and recomputes x_hat in backward, where the two per-channel sums of the input gradient are allreduced too
    (the adjoint of the statistics' allreduce)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):  # type: ignore[override]
        dims = (0, 2, 3)
        c = x.shape[1]
        stats = torch.cat([x.sum(dims, dtype=torch.float64), (x * x).sum(dims, dtype=torch.float64),
                           torch.tensor([x.shape[0] * x.shape[2] * x.shape[3]], dtype=torch.float64, device=x.device)])
        dist.all_reduce(stats, group=group)
        n = float(stats[2 * c])
        mean64 = stats[:c] / n
        var64 = (stats[c : 2 * c] / n - mean64 * mean64).clamp_min(0)
        invstd64 = torch.rsqrt(var64 + eps)
        mean, invstd = mean64.to(x.dtype), invstd64.to(x.dtype)
        scale = invstd if weight is None else invstd * weight.detach()
        shift = -mean * scale if bias is None else bias.detach() - mean * scale
        y = x * scale[None, :, None, None] + shift[None, :, None, None]
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n, ctx.group, ctx.has_bias = n, group, bias is not None
        ctx.mark_non_differentiable(mean64, var64)
        return y, mean64, var64, n

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dn):  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        dims = (0, 2, 3)
        view = (1, -1, 1, 1)
        xhat = (x - mean.view(view)) * invstd.view(view)
        local = torch.stack([dy.sum(dims), (dy * xhat).sum(dims)])  # d(bias), d(weight) on this tile
        sums = local.clone()
        dist.all_reduce(sums, group=ctx.group)
        w = weight.view(view) if weight is not None else 1.0
        dx = (dy - sums[0].view(view) / ctx.n - xhat * (sums[1].view(view) / ctx.n)) * invstd.view(view) * w
        dweight = local[1] if weight is not None else None
        dbias = local[0] if ctx.has_bias else None
        return dx, dweight, dbias, None, None


class SpatialBatchNorm2d(nn.BatchNorm2d, SpatialLayer):
    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, grid: SpatialGrid, *, name: str = "") -> "SpatialBatchNorm2d":
        new = copy.copy(bn)  # shares weight, bias and the running-stat buffers
        new.__class__ = cls
        new._init_spatial(grid, name)
        return new

    def windows(self, h: int, w: int):  # pointwise: any partition with enough rows works
        from lightning_hpc.strategies.spatial.halo_exchange import Window1d

        return Window1d(1), Window1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        use_batch_stats = self.training or not self.track_running_stats or self.running_mean is None
        if self.grid.size == 1 or not use_batch_stats:
            return super().forward(x)
        self._check_input_dim(x)
        y, mean64, var64, n = _AggregatedBatchNorm.apply(x, self.weight, self.bias, self.eps, self.grid.group)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean64, var64, n)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (n / max(n - 1.0, 1.0))
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
