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
    ceil = bool(pool.ceil_mode)
    return Window1d(k[0], s[0], p[0], d[0], ceil), Window1d(k[1], s[1], p[1], d[1], ceil)


def _divisors(win: Window1d, o0: int, o1: int, n: int, count_include_pad: bool) -> list[int]:
    """Per output ``[o0, o1)`` along one dimension of extent ``n``: the element count PyTorch's average pooling
    divides by, the window clipped to ``[-p, n + p)`` (``count_include_pad``) or to ``[0, n)``."""
    lo, hi = (-win.padding, n + win.padding) if count_include_pad else (0, n)
    starts = [o * win.stride - win.padding for o in range(o0, o1)]
    return [min(a + win.kernel, hi) - max(a, lo) for a in starts]


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
        if not any(plan.pads):  # every window lies inside the image: the plain average
            return F.avg_pool2d(xp, k, s, 0)
        (oa, ob), (oc, oe) = plan.out
        h, w = plan.rows.n, plan.cols.n
        rows = _divisors(wh, oa, ob, h, self.count_include_pad)
        cols = _divisors(ww, oc, oe, w, self.count_include_pad)
        if all(c == wh.kernel for c in rows) and all(c == ww.kernel for c in cols):
            return F.avg_pool2d(xp, k, s, 0)
        # the window sums, divided by PyTorch's counts (the padding and beyond-image entries of the box are 0)
        counts = xp.new_tensor(rows)[:, None] * xp.new_tensor(cols)
        return F.avg_pool2d(xp, k, s, 0, divisor_override=1) / counts

