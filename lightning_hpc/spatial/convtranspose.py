"""Transposed convolution on a tile with a halo exchange (exact, any stride, padding, output padding,
dilation and groups with ``stride <= dilation * (kernel - 1) + 1``).

Output ``o`` of a transposed convolution along one dimension sums inputs ``i`` with ``i*s + d*t - p = o`` for
``t = 0..k-1``, i.e. ``i`` in ``[ceil((o + p - d(k-1)) / s), floor((o + p) / s)]``.  :class:`TransposedWindow1d`
gives that input range for an output tile, so the halo exchange of :mod:`halo_exchange` brings exactly the
neighbouring rows this tile's (blocked) output rows need.  On the extended input box starting at input row
``lo`` the local ``conv_transpose2d`` without padding yields global outputs ``lo*s - p + q``; the rows of this
output tile are cut from it.  Backward is autograd's through the crop, the local kernel and the halo
exchange's adjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.halo_exchange import DimPlan, HaloPlan, halo_exchange
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["TransposedWindow1d", "transposed_plan", "tile_conv_transpose2d"]

Range = tuple[int, int]


@dataclass(frozen=True)
class TransposedWindow1d:
    """The inputs a transposed convolution's outputs read along one dimension."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    output_padding: int = 0

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    @property
    def exact_on_tiles(self) -> bool:
        """Every output has an input in its window (no stride gaps): the local kernel covers every output row."""
        return self.stride <= self.span

    def out_size(self, n: int) -> int:
        return (n - 1) * self.stride - 2 * self.padding + self.span + self.output_padding

    def needed(self, o0: int, o1: int, n: int) -> Range:
        """Global input range ``[lo, hi)`` read by outputs ``[o0, o1)`` (may reach outside ``[0, n)``: zeros)."""
        lo = math.ceil((o0 + self.padding - self.span + 1) / self.stride)
        hi = (o1 - 1 + self.padding) // self.stride + 1
        return lo, hi


def transposed_plan(grid: SpatialGrid, h: int, w: int, wh: TransposedWindow1d, ww: TransposedWindow1d) -> HaloPlan:
    """The halo plan of a transposed convolution with input ``h x w`` (raises PartitionError when a tile is
    smaller than the halo it needs)."""
    return HaloPlan(grid, DimPlan(h, wh.out_size(h), grid.parts[0], wh, what="H"),
                    DimPlan(w, ww.out_size(w), grid.parts[1], ww, what="W"))


def tile_conv_transpose2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: HaloPlan,
                          wh: TransposedWindow1d, ww: TransposedWindow1d, groups: int) -> torch.Tensor:
    """This output tile of ``conv_transpose2d`` of the split input whose local tile is ``x``."""
    box = halo_exchange(x, plan)  # input rows/cols plan.need, zeros outside the image
    y = F.conv_transpose2d(box, weight, bias, (wh.stride, ww.stride), 0, 0, groups, (wh.dilation, ww.dilation))
    (r_lo, _), (c_lo, _) = plan.need
    (o0, o1), (p0, p1) = plan.out
    q_r = o0 + wh.padding - r_lo * wh.stride
    q_c = p0 + ww.padding - c_lo * ww.stride
    return y[:, :, q_r : q_r + (o1 - o0), q_c : q_c + (p1 - p0)]
