"""BatchNorm2d over a spatially partitioned sample (section III-B).

The paper leaves open whether batch statistics should be tile-local or aggregated over the spatial
distribution of a sample; both are offered.  ``mode="aggregated"`` (the default) allreduces, per channel, the
sum and the sum of squares over the spatial group in one message (accumulated in float64 so the
``E[x^2] - E[x]^2`` form loses nothing at fp32 tolerance), so the normalisation, the gradients and the running
statistics (unbiased variance over the whole N x H x W) equal those of the unpartitioned layer on the same
samples.  ``mode="local"`` keeps plain ``nn.BatchNorm2d`` on each tile (cheaper, not equal to the serial
layer).  In eval mode the running statistics are used and nothing is communicated.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_hpc.strategies.spatial.collectives import all_reduce_sum
from lightning_hpc.strategies.spatial.layer import SpatialLayer
from lightning_hpc.strategies.spatial.tiling import SpatialGrid

__all__ = ["SpatialBatchNorm2d", "BN_MODES"]

BN_MODES = ("aggregated", "local")


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
        dims = (0, 2, 3)
        count_local = x.shape[0] * x.shape[2] * x.shape[3]
        stats = torch.cat(
            [
                x.sum(dims, dtype=torch.float64),
                (x * x).sum(dims, dtype=torch.float64),
                x.new_tensor([count_local], dtype=torch.float64),
            ]
        )
        stats = all_reduce_sum(stats, self.grid.group)
        c = x.shape[1]
        n = stats[2 * c]
        mean64 = stats[:c] / n
        var64 = (stats[c : 2 * c] / n - mean64 * mean64).clamp_min(0)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean64.detach(), var64.detach(), float(n.detach()))
        mean = mean64.to(x.dtype)[None, :, None, None]
        inv_std = torch.rsqrt(var64 + self.eps).to(x.dtype)[None, :, None, None]
        y = (x - mean) * inv_std
        if self.affine:
            y = y * self.weight[None, :, None, None] + self.bias[None, :, None, None]
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
