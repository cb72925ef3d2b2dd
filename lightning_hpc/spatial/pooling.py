"""Spatially partitioned MaxPool2d / AvgPool2d (section III-B: "pooling layers are parallelized similarly").

Same halo machinery as the convolution: the tile is extended by exactly the rows/columns its pooling windows
reach (kernel > stride overlaps neighbouring tiles, e.g. ResNet's 3x3/s2 max-pool), padded with -inf (max) or
0 (average) at the image border, then pooled with padding 0.  ``ceil_mode=True`` adds a last, partly
out-of-range window along a dimension; it reads only the last tile's rows (plus the -inf / 0 beyond the
image), so the same halo plan with the ceil-mode output count covers it.  Average pooling divides each window's
sum by the count PyTorch uses: the window clipped to the padded extent ``[-p, n + p)`` (``count_include_pad``)
or to the image ``[0, n)``, per dimension.  ``return_indices`` and ``divisor_override`` are not supported
(clear error at conversion).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_hpc.spatial.conv import _is_spatial
from lightning_hpc.spatial.halo_exchange import Window1d
from lightning_hpc.spatial.kernels.adaptive import adaptive_avg_pool_partial, adaptive_max_pool_partial
from lightning_hpc.spatial.kernels.pooling import planned_avg_pool, planned_max_pool, pooling_windows
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialMaxPool2d", "SpatialAvgPool2d", "pool_windows", "adaptive_avg_pool_tile", "adaptive_max_pool_tile"]


def pool_windows(pool: nn.MaxPool2d | nn.AvgPool2d) -> tuple[Window1d, Window1d]:
    wh, ww = pooling_windows(2, pool.kernel_size, pool.stride, pool.padding, getattr(pool, "dilation", 1),
                             bool(pool.ceil_mode))
    return wh, ww


def _check_pool(pool: nn.Module, name: str) -> None:
    if getattr(pool, "return_indices", False):
        raise ValueError(f"MaxPool2d '{name}': return_indices=True is not supported by the spatial layers")
    if getattr(pool, "divisor_override", None) is not None:
        raise ValueError(f"AvgPool2d '{name}': divisor_override is not supported by the spatial layers")


class _SpatialPool(SpatialLayer):
    """Conversion and halo plan shared by the two pools; subclasses pool the extended tile."""

    _wins: tuple[Window1d, Window1d]

    @classmethod
    def from_module(cls, pool: nn.MaxPool2d | nn.AvgPool2d, grid: SpatialGrid, *, name: str = ""):
        _check_pool(pool, name)
        new: Any = copy.copy(pool)  # a torch pool whose class becomes cls (a subclass of it)
        new.__class__ = cls
        assert isinstance(new, cls)
        new._init_spatial(grid, name)
        new._wins = pool_windows(pool)
        return new

    def windows(self, h: int, w: int):
        return self._wins


class SpatialMaxPool2d(_SpatialPool, nn.MaxPool2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return nn.MaxPool2d.forward(self, x)
        return planned_max_pool(x, self.halo_plan(*self.global_input_extent(x)), self._wins)


class SpatialAvgPool2d(_SpatialPool, nn.AvgPool2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return nn.AvgPool2d.forward(self, x)
        plan = self.halo_plan(*self.global_input_extent(x))
        return planned_avg_pool(x, plan, self._wins, bool(self.count_include_pad))


def adaptive_avg_pool_tile(x: torch.Tensor, group, extent: tuple[int, int], origin: tuple[int, int],
                           size: tuple[int, int]) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of a split activation to ``size``, replicated on every rank of ``group``
    (:func:`lightning_hpc.spatial.kernels.adaptive.adaptive_avg_pool_partial`)."""
    return adaptive_avg_pool_partial(x, group, extent, origin, size)


def adaptive_max_pool_tile(x: torch.Tensor, group, extent: tuple[int, int], origin: tuple[int, int],
                           size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.adaptive_max_pool2d(..., return_indices=True)`` of a split activation, replicated on every rank of
    ``group``: each window's maximum over the group, and its index ``h * W + w`` in the input plane
    (:func:`lightning_hpc.spatial.kernels.adaptive.adaptive_max_pool_partial`)."""
    return adaptive_max_pool_partial(x, group, extent, origin, size)
