"""Global average pooling over a spatially partitioned sample, so classification heads work (ResNet, Table III).

Each tile sums its own pixels; the partial sums are allreduced over the spatial group and divided by the
global H x W.  The pooled features are then *replicated* on every rank of the group, so the Linear head after
it runs unchanged (and identically) on every rank: its gradient is complete on each rank (the strategy
averages such replicated gradients) while the gradient flowing back into the tiles passes through the
reduction unchanged (:func:`collectives.all_reduce_replicated`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.spatial.collectives import all_reduce_replicated
from lightning_hpc.spatial.halo_exchange import Window1d
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialGlobalAvgPool2d"]


class SpatialGlobalAvgPool2d(nn.Module, SpatialLayer):
    """Replaces ``nn.AdaptiveAvgPool2d(1)``: output ``(N, C, 1, 1)``, replicated over the spatial group."""

    #: marks modules whose output is replicated: parameters after it get averaged, not summed
    replicated_output = True

    def __init__(self, grid: SpatialGrid, name: str = "") -> None:
        super().__init__()
        self._init_spatial(grid, name)

    @classmethod
    def from_module(cls, pool: nn.AdaptiveAvgPool2d, grid: SpatialGrid, *, name: str = "") -> SpatialGlobalAvgPool2d:
        size = pool.output_size
        if size not in (1, (1, 1), [1, 1]):
            raise ValueError(
                f"AdaptiveAvgPool2d '{name}': only output_size=1 (global pooling) is supported spatially, got {size}"
            )
        return cls(grid, name)

    def windows(self, h: int, w: int):
        return Window1d(1), Window1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_hpc.spatial.conv import _is_spatial

        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return x.mean((2, 3), keepdim=True)
        h, w = self.global_input_extent(x)
        partial = x.sum((2, 3), keepdim=True)
        return all_reduce_replicated(partial, self.grid.group) / float(h * w)

    def extra_repr(self) -> str:
        return f"spatial_parts={self.grid.parts}"
