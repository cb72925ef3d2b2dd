"""Transposed convolution on a tile with a halo exchange (exact, any stride, padding, output padding,
dilation and groups with ``stride <= dilation * (kernel - 1) + 1``).

Output ``o`` of a transposed convolution along one dimension sums inputs ``i`` with ``i*s + d*t - p = o`` for
``t = 0..k-1``, i.e. ``i`` in ``[ceil((o + p - d(k-1)) / s), floor((o + p) / s)]``.  :class:`TransposedWindow1d`
gives that input range for an output tile, so the halo exchange of :mod:`halo_exchange` brings exactly the
neighbouring rows this tile's (blocked) output rows need.  On the extended input box starting at input row
``lo`` the local ``conv_transpose2d`` without padding yields global outputs ``lo*s - p + q``; the rows of this
output tile are cut from it (:func:`lightning_hpc.spatial.kernels.transposed.transposed_from_box`, the N-d
kernel).  Backward is autograd's through the crop, the local kernel and the halo exchange's adjoint.
"""

from __future__ import annotations

import torch

from lightning_hpc.spatial.halo_exchange import DimPlan, HaloPlan, halo_exchange
from lightning_hpc.spatial.kernels.transposed import TransposedWindow1d, transposed_from_box
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["TransposedWindow1d", "transposed_plan", "tile_conv_transpose2d"]

def transposed_plan(grid: SpatialGrid, h: int, w: int, wh: TransposedWindow1d, ww: TransposedWindow1d) -> HaloPlan:
    """The halo plan of a transposed convolution with input ``h x w`` (raises PartitionError when a tile is
    smaller than the halo it needs)."""
    return HaloPlan(grid, DimPlan(h, wh.out_size(h), grid.parts[0], wh, what="H"),
                    DimPlan(w, ww.out_size(w), grid.parts[1], ww, what="W"))


def tile_conv_transpose2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: HaloPlan,
                          wh: TransposedWindow1d, ww: TransposedWindow1d, groups: int) -> torch.Tensor:
    """This output tile of ``conv_transpose2d`` of the split input whose local tile is ``x``."""
    box = halo_exchange(x, plan)  # input rows/cols plan.need, zeros outside the image
    return transposed_from_box(box, weight, bias, plan, (wh, ww), groups)
