"""BatchNorm2d over a spatially partitioned sample (section III-B).

The paper leaves open whether batch statistics should be tile-local or aggregated over the spatial
distribution of a sample; both are offered.  ``mode="aggregated"`` (the default) gathers, per channel, the
tile's mean, variance and count over the spatial group in one message and combines them in float64 (Chan et
al.'s pairwise update), so the normalisation, the gradients and the running
statistics (unbiased variance over the whole N x H x W) equal those of the unpartitioned layer on the same
samples.  Backward allreduces the two per-channel sums of the output gradient (the adjoint of the statistics'
allreduce); weight and bias gradients stay tile-local partial sums, summed over the group by the strategy.
``mode="local"`` keeps plain ``nn.BatchNorm2d`` on each tile (cheaper, not equal to the serial
layer).  In eval mode the running statistics are used and nothing is communicated.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_hpc.spatial.kernels.normalization import _AggregatedBatchNorm
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialBatchNorm2d", "BN_MODES"]

BN_MODES = ("aggregated", "local")


class SpatialBatchNorm2d(nn.BatchNorm2d, SpatialLayer):
    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, grid: SpatialGrid, *, name: str = "") -> SpatialBatchNorm2d:
        new = copy.copy(bn)  # shares weight, bias and the running-stat buffers
        new.__class__ = cls
        assert isinstance(new, cls)
        new._init_spatial(grid, name)
        return new

    def windows(self, h: int, w: int):  # pointwise: any partition with enough rows works
        from lightning_hpc.spatial.halo_exchange import Window1d

        return Window1d(1), Window1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from lightning_hpc.spatial.conv import _is_spatial

        if _is_spatial(x):
            return self.spatial_call(x)
        use_batch_stats = self.training or not self.track_running_stats or self.running_mean is None
        if self._serial_input(x) or not use_batch_stats:
            return super().forward(x)
        self._check_input_dim(x)
        y, mean64, var64, n = _AggregatedBatchNorm.apply(x, self.weight, self.bias, self.eps, self.grid.group)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean64, var64, n)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        assert self.num_batches_tracked is not None  # a buffer whenever running statistics are tracked
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (n / max(n - 1.0, 1.0))
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
