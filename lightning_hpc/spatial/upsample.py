"""Spatially partitioned nn.Upsample (nearest, bilinear) for segmentation heads.

The output (blocked over the grid like every activation) is computed from global source coordinates, exactly
as PyTorch's kernels do for the whole image: output row ``o`` reads source rows ``floor(o * scale)``
(nearest) or ``floor(src), floor(src) + 1`` with ``src = (o + 0.5) * scale - 0.5`` clamped at 0 (bilinear,
``align_corners=False``; ``src = o * (n - 1) / (n_out - 1)`` with ``align_corners=True``).  The rows a tile
needs but does not own come by halo exchange (at most one or two rows).  Separable: H first, then W.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from lightning_hpc.spatial.halo_exchange import halo_exchange
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialUpsample", "Interp1d"]


@dataclass(frozen=True)
class Interp1d:
    """Interpolation along one dimension from extent ``n_in`` to ``n_out``."""

    mode: str
    n_in: int
    n_out: int
    scale: float  # source step per output index, as PyTorch computes it
    align_corners: bool = False

    def out_size(self, n: int) -> int:
        return self.n_out

    def sources(self, o0: int, o1: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global source indices i0, i1 and weight of i1 for outputs ``[o0, o1)`` (float32 like PyTorch's CPU
        kernel)."""
        o = torch.arange(o0, o1, device=device, dtype=torch.float32)
        if self.mode == "nearest":
            i0 = torch.clamp(torch.floor(o * torch.tensor(self.scale, dtype=torch.float32)).long(), max=self.n_in - 1)
            return i0, i0, torch.zeros_like(o)
        if self.align_corners:
            src = o * torch.tensor(self.scale, dtype=torch.float32)
        else:
            src = torch.clamp((o + 0.5) * torch.tensor(self.scale, dtype=torch.float32) - 0.5, min=0.0)
        i0 = torch.clamp(torch.floor(src).long(), max=self.n_in - 1)
        i1 = torch.clamp(i0 + 1, max=self.n_in - 1)
        return i0, i1, src - i0.to(torch.float32)

    def needed(self, o0: int, o1: int, n: int) -> tuple[int, int]:
        i0, i1, _ = self.sources(o0, o1)
        return int(i0.min()), int(i1.max()) + 1


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

    def windows(self, h: int, w: int):
        out = []
        for dim, n in enumerate((h, w)):
            if self.size is not None:
                size = self.size if isinstance(self.size, int) else self.size[dim]
                n_out, scale = int(size), n / int(size)
            else:
                assert self.scale_factor is not None  # nn.Upsample has a size or a scale factor
                sf = self.scale_factor if isinstance(self.scale_factor, (int, float)) else self.scale_factor[dim]
                n_out, scale = int(math.floor(n * float(sf))), 1.0 / float(sf)
            if self.mode == "bilinear" and self.align_corners:
                scale = (n - 1) / (n_out - 1) if n_out > 1 else 0.0
            out.append(Interp1d(self.mode, n, n_out, scale, bool(self.align_corners)))
        return tuple(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from lightning_hpc.spatial.conv import _is_spatial

        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            return super().forward(x)
        h, w = self.global_input_extent(x)
        plan = self.halo_plan(h, w)
        xp = halo_exchange(x, plan)  # interpolation never reaches outside the image: no padding
        wins = self.windows(h, w)
        for dim, (win, (o0, o1), (lo, _)) in enumerate(zip(wins, plan.out, plan.need)):
            i0, i1, lam = win.sources(o0, o1, device=x.device)
            axis = 2 + dim
            a = xp.index_select(axis, i0 - lo)
            if win.mode == "nearest":
                xp = a
                continue
            b = xp.index_select(axis, i1 - lo)
            shape = [1, 1, 1, 1]
            shape[axis] = -1
            lam = lam.to(x.dtype).view(shape)
            xp = a * (1 - lam) + b * lam
        return xp
