"""Spatially partitioned nn.Upsample (nearest, bilinear) for segmentation heads.

The output (blocked over the grid like every activation) is computed from global source coordinates, exactly
as PyTorch's kernels do for the whole image: output row ``o`` reads source rows ``floor(o * scale)``
(nearest) or ``floor(src), floor(src) + 1`` with ``src = (o + 0.5) * scale - 0.5`` clamped at 0 (bilinear,
``align_corners=False``; ``src = o * (n - 1) / (n_out - 1)`` with ``align_corners=True``).  The rows a tile
needs but does not own come by halo exchange (at most one or two rows).  The kernel is the N-d one of
:mod:`lightning_hpc.spatial.kernels.interpolation` on this layer's (cached) halo plan.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_hpc.spatial.kernels.interpolation import Interp1d, interpolation_windows, planned_interpolate
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialUpsample", "Interp1d"]


class SpatialUpsample(nn.Upsample, SpatialLayer):
    @classmethod
    def from_module(cls, up: nn.Upsample, grid: SpatialGrid, *, name: str = "") -> SpatialUpsample:
        if up.mode not in ("nearest", "bilinear"):
            raise ValueError(
                f"Upsample '{name}': mode={up.mode!r} is not supported spatially; use 'nearest' or 'bilinear'"
            )
        if getattr(up, "recompute_scale_factor", None):
            raise ValueError(f"Upsample '{name}': recompute_scale_factor=True is not supported spatially")
        new = copy.copy(up)
        new.__class__ = cls
        assert isinstance(new, cls)
        new._init_spatial(grid, name)
        return new

    def windows(self, h: int, w: int) -> tuple[Interp1d, Interp1d]:
        wh, ww = interpolation_windows((h, w), self.size, self.scale_factor, self.mode, self.align_corners,
                                       self.recompute_scale_factor)
        return wh, ww

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from lightning_hpc.spatial.conv import _is_spatial

        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return super().forward(x)
        h, w = self.global_input_extent(x)
        return planned_interpolate(x, self.halo_plan(h, w), self.windows(h, w))
