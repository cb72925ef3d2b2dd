"""Spatially partitioned MaxPool2d / AvgPool2d (section III-B: "pooling layers are parallelized similarly").

Same halo machinery as the convolution: the tile is extended by exactly the rows/columns its pooling windows
reach (kernel > stride overlaps neighbouring tiles, e.g. ResNet's 3x3/s2 max-pool), padded with -inf (max) or
0 (average) at the image border, then pooled with padding 0.  ``count_include_pad=False`` divides by the number
of real (non-padding) elements, counted the same way on a mask.  ``ceil_mode`` and ``return_indices`` are not
supported (clear error at conversion).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.conv import _is_spatial, _pair
from lightning_hpc.spatial.halo_exchange import Window1d, halo_exchange
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialMaxPool2d", "SpatialAvgPool2d", "pool_windows"]


def pool_windows(pool: nn.MaxPool2d | nn.AvgPool2d) -> tuple[Window1d, Window1d]:
    k = _pair(pool.kernel_size)
    s = _pair(pool.stride if pool.stride is not None else pool.kernel_size)
    p = _pair(pool.padding)
    d = _pair(getattr(pool, "dilation", 1))
    return Window1d(k[0], s[0], p[0], d[0]), Window1d(k[1], s[1], p[1], d[1])


def _check_pool(pool: nn.Module, name: str) -> None:
    if getattr(pool, "ceil_mode", False):
        raise ValueError(f"{type(pool).__name__} '{name}': ceil_mode=True is not supported by the spatial layers; use ceil_mode=False")
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
        plan = self.halo_plan(*self.global_input_extent(x))
        xp = halo_exchange(x, plan, pad_value=float("-inf"))
        wh, ww = self._wins
        return F.max_pool2d(xp, (wh.kernel, ww.kernel), (wh.stride, ww.stride), 0, (wh.dilation, ww.dilation))


class SpatialAvgPool2d(_SpatialPool, nn.AvgPool2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return nn.AvgPool2d.forward(self, x)
        plan = self.halo_plan(*self.global_input_extent(x))
        xp = halo_exchange(x, plan, pad_value=0.0)
        wh, ww = self._wins
        k, s = (wh.kernel, ww.kernel), (wh.stride, ww.stride)
        y = F.avg_pool2d(xp, k, s, 0)
        pads = plan.pads
        if not self.count_include_pad and any(pads):
            (r0, r1), (c0, c1) = plan.need_clamped
            ones = xp.new_ones(1, 1, r1 - r0, c1 - c0)
            frac = F.avg_pool2d(F.pad(ones, pads), k, s, 0)
            y = y / frac
        return y
