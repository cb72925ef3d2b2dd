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
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.kernels.plan import halo_plan, ntuple
from lightning_hpc.spatial.layout.halo_exchange import Window1d, halo_exchange
from lightning_hpc.spatial.layout.tiling import SpatialGrid

__all__ = ["pooling_windows", "max_pool", "avg_pool", "pool_divisors"]

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


def avg_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], kernel_size: Any, stride: Any = None,
             padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True,
             divisor_override: int | None = None) -> torch.Tensor:
    """This rank's output tile of ``F.avg_pool{k}d(x_global, kernel_size, stride, padding, ceil_mode,
    count_include_pad, divisor_override)`` (``divisor_override``: 2-D and 3-D in torch, accepted for 1-D too)."""
    k = grid.ndim
    windows = pooling_windows(k, kernel_size, stride, padding, 1, ceil_mode)
    plan = halo_plan(grid, extents, windows, f"avg_pool{k}d", tile=x)
    box = halo_exchange(x, plan, pad_value=0.0)
    kernel, stride, _ = _window_args(windows)
    key = ("pool_divisors", tuple(windows), count_include_pad)
    if key not in plan.memo:  # a pure function of the (cached) plan
        plan.memo[key] = [pool_divisors(win, o0, o1, dim.n, count_include_pad) for win, (o0, o1), dim in
                          zip(windows, plan.out, plan.dims)]
    divs = plan.memo[key]
    if not divisor_override and all(c == win.kernel for div, win in zip(divs, windows) for c in div):
        return _AVG[k](box, kernel, stride, 0)  # every window whole (or counted whole): the plain average
    sums = _sum_pool(box, kernel, stride)
    if divisor_override:
        return sums / divisor_override
    counts = torch.ones((), dtype=sums.dtype, device=sums.device)
    for e, div in enumerate(divs):  # per output, the product of its window's counts along each dimension
        counts = counts * sums.new_tensor(div).view([-1 if j == e else 1 for j in range(k)])
    return sums / counts


def max_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], kernel_size: Any, stride: Any = None,
             padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> torch.Tensor:
    """This rank's output tile of ``F.max_pool{k}d(x_global, kernel_size, stride, padding, dilation, ceil_mode)``
    (``x``: this rank's tile of a sample whose split dimensions have global ``extents``; the output is blocked over
    the output's global extents).  ``return_indices`` is not offered (indices would be global positions)."""
    k = grid.ndim
    windows = pooling_windows(k, kernel_size, stride, padding, dilation, ceil_mode)
    plan = halo_plan(grid, extents, windows, f"max_pool{k}d", tile=x)
    box = halo_exchange(x, plan, pad_value=float("-inf"))  # -inf never wins a maximum: torch skips the padding
    kernel, stride, dilation = _window_args(windows)
    return _MAX[k](box, kernel, stride, 0, dilation)
