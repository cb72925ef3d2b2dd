"""Max and average pooling (``F.max_pool1d/2d/3d``, ``F.avg_pool1d/2d/3d``) of a tile split over 1, 2 or 3 spatial
dimensions (Dryden et al., section III-B: "pooling layers are parallelized similarly" to convolution).

The tile is extended by exactly the entries its pooling windows reach (:func:`pooling_windows`; kernel > stride
overlaps neighbouring tiles, e.g. ResNet's 3x3/s2 max-pool), padded with -inf (max) or 0 (average) at the
sample's border, then pooled with padding 0.  ``ceil_mode=True`` adds a last, partly out-of-range window along a
dimension; it reads only the last tile's entries (plus the -inf / 0 beyond the sample), so the same halo plan
with the ceil-mode output count covers it.  Average pooling divides each window's sum by the count torch uses:
the window clipped to the padded extent ``[-p, n + p)`` (``count_include_pad``) or to the sample ``[0, n)``, per
dimension (torch's ``avg_pool`` kernels), or by ``divisor_override``.  Gradients are autograd's through the
native pooling and the exchange's adjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.kernels.plan import halo_plan, ntuple
from lightning_hpc.spatial.layout.halo_exchange import HaloPlan, Window1d, halo_exchange
from lightning_hpc.spatial.layout.tiling import SpatialGrid

__all__ = ["pooling_windows", "max_pool", "avg_pool", "pool_divisors", "PoolPlan", "plan_pool", "run_pool"]

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def pooling_windows(k: int, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                    ceil_mode: bool = False) -> tuple[Window1d, ...]:
    """Per split dimension (``k`` of them), the input window of each output of a max / average pooling with
    torch's arguments (``stride=None`` or empty: the kernel size; average pooling has no dilation)."""
    kernel = ntuple(kernel_size, k, "kernel_size")
    s = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) else ntuple(stride, k, "stride")
    p, d = ntuple(padding, k, "padding"), ntuple(dilation, k, "dilation")
    for kk, pp, dd in zip(kernel, p, d):
        if pp > (dd * (kk - 1) + 1) // 2:  # torch refuses it too: a window of padding only
            raise ValueError(f"pooling: padding {pp} is more than half the kernel span {dd * (kk - 1) + 1} (as torch "
                             f"requires, pad should be at most half of the effective kernel size)")
    return tuple(Window1d(kk, ss, pp, dd, bool(ceil_mode)) for kk, ss, pp, dd in zip(kernel, s, p, d))


def pool_divisors(win: Window1d, o0: int, o1: int, n: int, count_include_pad: bool) -> list[int]:
    """Per output ``[o0, o1)`` along one dimension of extent ``n``: the element count torch's average pooling
    divides by, the window clipped to ``[-p, n + p)`` (``count_include_pad``) or to ``[0, n)``."""
    lo, hi = (-win.padding, n + win.padding) if count_include_pad else (0, n)
    starts = [o * win.stride - win.padding for o in range(o0, o1)]
    return [min(a + win.kernel, hi) - max(a, lo) for a in starts]


def _window_args(windows: Sequence[Window1d]) -> tuple[list[int], list[int], list[int]]:
    return [w.kernel for w in windows], [w.stride for w in windows], [w.dilation for w in windows]


def _sum_pool(box: torch.Tensor, kernel: list[int], stride: list[int]) -> torch.Tensor:
    """Window sums (``divisor_override=1``, which ``F.avg_pool1d`` lacks: 1-D runs as 2-D with a unit height)."""
    k = len(kernel)
    if k == 1:
        return F.avg_pool2d(box.unsqueeze(-2), [1, kernel[0]], [1, stride[0]], 0, divisor_override=1).squeeze(-2)
    return (F.avg_pool2d if k == 2 else F.avg_pool3d)(box, kernel, stride, 0, divisor_override=1)


@dataclass(frozen=True)
class PoolPlan:
    """Everything one max / average pooling call decides from its layout and arguments alone: the halo plan, the
    native pooling's arguments over the box and, for an average whose windows are not all counted whole, the
    per-output divisors (on the host).  Made once per distinct call by :func:`plan_pool` and replayed by
    :func:`run_pool` (the op dispatch caches it per call)."""

    kind: str  # "max" or "avg"
    plan: HaloPlan
    kernel: list[int]
    stride: list[int]
    dilation: list[int]
    #: average pooling: None where every window is counted whole (the plain average), else the divisors per
    #: output along each split dimension, or ``divisor_override``
    divisors: list[list[int]] | int | None
    out_extents: tuple[int, ...]
    #: the divisors as one tensor per (device, dtype), made on the first call there: made from the host lists on
    #: every call, they would be an upload per call (on a GPU, a wait for the queue)
    _counts: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False,
                                                                          repr=False)

    def counts(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Per output position, the product of its window's counts along each split dimension (``divisors`` as a
        list of lists), broadcastable over the pooled tile."""
        assert isinstance(self.divisors, list)
        out = self._counts.get((device, dtype))
        if out is None:
            k = len(self.kernel)
            out = torch.ones((), dtype=dtype)
            for e, div in enumerate(self.divisors):
                out = out * torch.tensor(div, dtype=dtype).view([-1 if j == e else 1 for j in range(k)])
            out = self._counts[(device, dtype)] = out.to(device)
        return out


def plan_pool(grid: SpatialGrid, extents: Sequence[int], kind: str, kernel_size: Any, stride: Any = None,
              padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False, count_include_pad: bool = True,
              divisor_override: int | None = None, *, tile: torch.Tensor | None = None) -> PoolPlan:
    """The :class:`PoolPlan` of ``F.{kind}_pool{k}d`` over a tile of ``grid`` (``tile`` checked against the plan's
    block when given; average pooling has no dilation)."""
    k = grid.ndim
    windows = pooling_windows(k, kernel_size, stride, padding, dilation if kind == "max" else 1, ceil_mode)
    plan = halo_plan(grid, extents, windows, f"{kind}_pool{k}d", tile=tile)
    kernel, strides, dilations = _window_args(windows)
    divisors: list[list[int]] | int | None = None
    if kind == "avg":
        divs = [pool_divisors(win, o0, o1, dim.n, count_include_pad) for win, (o0, o1), dim in
                zip(windows, plan.out, plan.dims)]
        if divisor_override:
            divisors = int(divisor_override)
        elif not all(c == win.kernel for div, win in zip(divs, windows) for c in div):
            divisors = divs
    return PoolPlan(kind, plan, kernel, strides, dilations, divisors,
                    tuple(win.out_size(int(n)) for n, win in zip(extents, windows)))


def run_pool(x: torch.Tensor, pp: PoolPlan) -> torch.Tensor:
    """This rank's output tile of the pooling ``pp`` plans, on the tile ``x``."""
    k = len(pp.kernel)
    if pp.kind == "max":
        box = halo_exchange(x, pp.plan, pad_value=float("-inf"))  # -inf never wins a maximum: torch skips padding
        return _MAX[k](box, pp.kernel, pp.stride, 0, pp.dilation)
    box = halo_exchange(x, pp.plan, pad_value=0.0)
    if pp.divisors is None:
        return _AVG[k](box, pp.kernel, pp.stride, 0)  # every window whole (or counted whole): the plain average
    sums = _sum_pool(box, pp.kernel, pp.stride)
    if isinstance(pp.divisors, int):
        return sums / pp.divisors
    return sums / pp.counts(sums.device, sums.dtype)


def avg_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], kernel_size: Any, stride: Any = None,
             padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True,
             divisor_override: int | None = None) -> torch.Tensor:
    """This rank's output tile of ``F.avg_pool{k}d(x_global, kernel_size, stride, padding, ceil_mode,
    count_include_pad, divisor_override)`` (``divisor_override``: 2-D and 3-D in torch, accepted for 1-D too).
    (:func:`plan_pool` + :func:`run_pool`.)"""
    return run_pool(x, plan_pool(grid, extents, "avg", kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                                 divisor_override, tile=x))


def max_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], kernel_size: Any, stride: Any = None,
             padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> torch.Tensor:
    """This rank's output tile of ``F.max_pool{k}d(x_global, kernel_size, stride, padding, dilation, ceil_mode)``
    (``x``: this rank's tile of a sample whose split dimensions have global ``extents``; the output is blocked over
    the output's global extents).  ``return_indices`` is not offered (indices would be global positions).
    (:func:`plan_pool` + :func:`run_pool`.)"""
    return run_pool(x, plan_pool(grid, extents, "max", kernel_size, stride, padding, dilation, ceil_mode, tile=x))
