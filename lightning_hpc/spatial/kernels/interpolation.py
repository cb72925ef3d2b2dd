"""Interpolation (``F.interpolate`` with mode ``nearest``, ``nearest-exact``, ``linear``, ``bilinear``,
``trilinear``; ``align_corners`` both ways; ``size`` or ``scale_factor``) of a tile split over 1, 2 or 3 spatial
dimensions (an upsampling head on split activations: the halo exchange of Dryden et al., section III-A).

The output (blocked over the grid like every activation) is computed from global source coordinates, exactly as
torch's CPU kernels compute them for the whole sample (``aten/src/ATen/native/UpSample.h``):

* nearest: output ``o`` reads ``min(floor(o * scale), n - 1)`` in float32, ``scale = 1 / scale_factor`` when a
  scale factor is given (and not recomputed), else ``n / n_out``; ``o`` itself when ``n_out == n`` and
  ``o // 2`` when ``n_out == 2n``; nearest-exact reads ``min(floor((o + 0.5) * scale), n - 1)``;
* linear: ``src = scale * (o + 0.5) - 0.5`` clamped at 0 (``align_corners=False``) or ``src = o * (n - 1) /
  (n_out - 1)`` (``align_corners=True``), in the input's precision (float64 for float64, else float32), and the
  output is ``(1 - l) * x[i0] + l * x[i1]`` with ``i0 = min(floor(src), n - 1)``, ``i1 = min(i0 + 1, n - 1)``,
  ``l = clamp(src - i0, 0, 1)``.

The entries a tile needs but does not own (at most one or two per side) come by halo exchange
(:func:`interpolation_windows` gives the range); interpolation never reads outside the sample.  Separable: the
last dimension first, as torch's kernel nests its weights.  Gradients are autograd's through the index selects and
the exchange's adjoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_hpc.spatial.kernels.plan import halo_plan
from lightning_hpc.spatial.layout.halo_exchange import HaloPlan, halo_exchange
from lightning_hpc.spatial.layout.tiling import SpatialGrid

__all__ = ["Interp1d", "InterpolationPlan", "interpolation_windows", "interpolate", "plan_interpolation",
           "run_interpolation"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


@dataclass(frozen=True)
class Interp1d:
    """Interpolation along one dimension from extent ``n_in`` to ``n_out``: ``scale_factor`` is the user's factor
    when torch passes it to the kernel (``None`` when ``size`` was given or the factor recomputed)."""

    mode: str
    n_in: int
    n_out: int
    scale_factor: float | None = None
    align_corners: bool = False

    def out_size(self, n: int) -> int:
        return self.n_out

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        """torch's ``area_pixel_compute_scale`` / ``compute_scales_value`` in ``dtype``."""
        if self.mode != "nearest" and self.mode != "nearest-exact" and self.align_corners:
            if self.n_out <= 1:
                return torch.tensor(0.0, dtype=dtype)
            # (n_in - 1) / (n_out - 1) divided in ``dtype``, as torch divides in the op's math type
            return torch.tensor(self.n_in - 1, dtype=dtype) / (self.n_out - 1)
        if self.scale_factor is not None and self.scale_factor > 0:
            return torch.tensor(1.0 / self.scale_factor, dtype=dtype)
        return torch.tensor(self.n_in, dtype=dtype) / self.n_out

    def sources(self, o0: int, o1: int, dtype: torch.dtype = torch.float32,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global source indices ``i0``, ``i1`` and the weight ``l`` of ``i1`` for outputs ``[o0, o1)`` (``l`` in
        the precision torch computes it for an input of ``dtype``)."""
        last = self.n_in - 1
        if self.mode in ("nearest", "nearest-exact"):
            o = torch.arange(o0, o1, dtype=torch.int64)
            if self.mode == "nearest" and self.n_out == self.n_in:
                i0 = o
            elif self.mode == "nearest" and self.n_out == 2 * self.n_in:
                i0 = o // 2
            else:
                of = o.to(torch.float32) + (0.5 if self.mode == "nearest-exact" else 0.0)
                i0 = torch.clamp(torch.floor(of * self._scale(torch.float32)).long(), max=last)
            i0 = i0.to(device)
            return i0, i0, torch.zeros(i0.shape, dtype=dtype, device=device)
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        o = torch.arange(o0, o1, dtype=cdt)
        scale = self._scale(cdt)
        src = o * scale if self.align_corners else torch.clamp(scale * (o + 0.5) - 0.5, min=0.0)
        i0 = torch.clamp(torch.floor(src).long(), max=last)
        i1 = torch.clamp(i0 + 1, max=last)
        lam = torch.clamp(src - i0.to(cdt), 0.0, 1.0)
        return i0.to(device), i1.to(device), lam.to(device=device)

    def needed(self, o0: int, o1: int, n: int) -> tuple[int, int]:
        # the union over both index precisions, so one plan serves every input dtype
        lo, hi = n, 0
        for dtype in (torch.float32, torch.float64):
            i0, i1, _ = self.sources(o0, o1, dtype)
            lo, hi = min(lo, int(i0.min())), max(hi, int(i1.max()) + 1)
        return lo, hi


def interpolation_windows(extents: Sequence[int], size: Any = None, scale_factor: Any = None,
                          mode: str = "nearest", align_corners: bool | None = None,
                          recompute_scale_factor: bool | None = None) -> tuple[Interp1d, ...]:
    """Per split dimension of global extent ``extents[e]``, the interpolation of ``F.interpolate`` with these
    arguments (torch's output sizes: ``size``, or ``floor(n * scale_factor)``)."""
    k = len(extents)
    if mode not in ("nearest", "nearest-exact", *_LINEAR):
        raise ValueError(f"interpolate: mode={mode!r} is not supported on split tiles; use nearest, nearest-exact, "
                         f"linear, bilinear or trilinear")
    if mode in _LINEAR and _LINEAR[mode] != k:
        raise ValueError(f"interpolate: mode={mode!r} is for {_LINEAR[mode]} spatial dimensions, the input has {k}")
    if align_corners is not None and mode not in _LINEAR:
        raise ValueError("interpolate: align_corners only applies to the linear modes (as in torch)")
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    out = []
    for e, n in enumerate(extents):
        if size is not None:
            n_out, sf = int(size if isinstance(size, int) else size[e]), None
        else:
            f = float(scale_factor if isinstance(scale_factor, (int, float)) else scale_factor[e])
            n_out = math.floor(float(n * f))
            sf = None if recompute_scale_factor else f
        out.append(Interp1d(mode, int(n), n_out, sf, bool(align_corners)))
    return tuple(out)


@dataclass(frozen=True)
class InterpolationPlan:
    """Everything one interpolation call decides from its layout and arguments alone: the halo plan and, per split
    dimension in the order applied (the last first), the axis, the source indices into the tile with its halo and
    the weights (on the device, in the input's precision).  Made once per distinct call by
    :func:`plan_interpolation` and replayed by :func:`run_interpolation` (the op dispatch caches it per call)."""

    plan: HaloPlan
    #: per step: (axis, i0 - lo, i1 - lo or None for the nearest modes, the weight of i1 shaped along the axis)
    steps: tuple[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], ...]
    out_extents: tuple[int, ...]


def plan_interpolation(grid: SpatialGrid, extents: Sequence[int], ndim: int, size: Any = None,
                       scale_factor: Any = None, mode: str = "nearest", align_corners: bool | None = None,
                       recompute_scale_factor: bool | None = None, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | None = None, tile: torch.Tensor | None = None) -> InterpolationPlan:
    """The :class:`InterpolationPlan` of ``F.interpolate`` over a tile of ``grid`` with ``ndim`` dimensions in all
    (``tile`` checked against the plan's block when given)."""
    windows = interpolation_windows(extents, size, scale_factor, mode, align_corners, recompute_scale_factor)
    plan = halo_plan(grid, extents, windows, f"interpolate({mode})", tile=tile)
    k = plan.ndim
    steps: list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    for e in reversed(range(k)):  # the last dimension innermost, as torch nests the weights
        win, (o0, o1), (lo, _) = windows[e], plan.out[e], plan.need[e]
        i0, i1, lam = win.sources(o0, o1, dtype=dtype, device=device)
        if win.mode in ("nearest", "nearest-exact"):
            steps.append((ndim - k + e, i0 - lo, None, None))
        else:  # the weight along dimension e of the split ones
            steps.append((ndim - k + e, i0 - lo, i1 - lo, lam.view([-1 if j == e else 1 for j in range(k)])))
    return InterpolationPlan(plan, tuple(steps), tuple(win.out_size(int(n)) for n, win in zip(extents, windows)))


def run_interpolation(x: torch.Tensor, ip: InterpolationPlan) -> torch.Tensor:
    """This rank's output tile of the interpolation ``ip`` plans, on the tile ``x``."""
    xp = halo_exchange(x, ip.plan)  # interpolation never reaches outside the sample: no padding
    for axis, i0, i1, lam in ip.steps:
        a = xp.index_select(axis, i0)
        if i1 is None or lam is None:
            xp = a
            continue
        b = xp.index_select(axis, i1)
        xp = ((1 - lam) * a + lam * b).to(x.dtype)
    return xp


def interpolate(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], size: Any = None, scale_factor: Any = None,
                mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None) -> torch.Tensor:
    """This rank's output tile of ``F.interpolate(x_global, size, scale_factor, mode, align_corners,
    recompute_scale_factor)`` (``x``: this rank's tile of a sample whose split dimensions have global
    ``extents``; the output is blocked over the output's global extents).  (:func:`plan_interpolation` +
    :func:`run_interpolation`.)"""
    return run_interpolation(x, plan_interpolation(grid, extents, x.dim(), size, scale_factor, mode, align_corners,
                                                   recompute_scale_factor, dtype=x.dtype, device=x.device, tile=x))
