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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.conv import _is_spatial, _pair
from lightning_hpc.spatial.halo_exchange import Window1d, halo_exchange
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialMaxPool2d", "SpatialAvgPool2d", "pool_windows", "adaptive_avg_pool_tile", "adaptive_max_pool_tile"]


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


def _adaptive_windows(n: int, k: int, lo: int, hi: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, list[int]]:
    """For ``F.adaptive_avg_pool2d`` along one dimension of extent ``n`` to ``k`` outputs: the ``k x (hi - lo)``
    0/1 matrix of which of the tile's rows ``[lo, hi)`` fall in each window ``[floor(i*n/k), ceil((i+1)*n/k))``,
    and the windows' sizes."""
    starts = [i * n // k for i in range(k)]
    ends = [-(-(i + 1) * n // k) for i in range(k)]
    rows = torch.arange(lo, hi, device=device)
    lo_t, hi_t = torch.tensor(starts, device=device)[:, None], torch.tensor(ends, device=device)[:, None]
    sel = (rows[None, :] >= lo_t) & (rows[None, :] < hi_t)
    return sel.to(dtype), [e - s for s, e in zip(starts, ends)]


def adaptive_avg_pool_tile(x: torch.Tensor, group, extent: tuple[int, int], origin: tuple[int, int],
                           size: tuple[int, int]) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of a split activation to ``size``, replicated on every rank of ``group``: each
    window's sum over this tile's rows ``origin + [0, tile)`` (a window may straddle tiles), summed over the
    group and divided by the window's size.  Gradient: every rank holds the whole output gradient; the tile's
    part of it follows from the tile's window sums."""
    from lightning_hpc.spatial.collectives import all_reduce_replicated

    # float32 sums for reduced-precision inputs, as the serial kernel accumulates them
    cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    (h, w), (h0, w0), (kh, kw) = extent, origin, size
    ah, nh = _adaptive_windows(h, kh, h0, h0 + x.shape[2], cdt, x.device)
    aw, nw = _adaptive_windows(w, kw, w0, w0 + x.shape[3], cdt, x.device)
    with torch.autocast(x.device.type, enabled=False):  # autocast would run the sums as a bf16 matrix product
        partial = torch.einsum("ih,nchw,jw->ncij", ah, x.to(cdt), aw)
    total = all_reduce_replicated(partial, group)
    counts = torch.tensor(nh, dtype=cdt, device=x.device)[:, None] * torch.tensor(nw, dtype=cdt, device=x.device)
    return (total / counts).to(x.dtype)


class _AdaptiveMax(torch.autograd.Function):
    """Window maxima over the spatial group and the global index of the first maximum of each window in
    row-major order (where the serial kernel puts a tie's gradient); backward adds the (replicated) output
    gradient at the indices this tile owns."""

    @staticmethod
    def forward(ctx, x, group, extent, origin, size):  # type: ignore[override]
        (h, w), (h0, w0), (kh, kw) = extent, origin, size
        th, tw = x.shape[2], x.shape[3]
        rows, cols = ([(i * n // k, -(-(i + 1) * n // k)) for i in range(k)] for n, k in ((h, kh), (w, kw)))
        vals = x.new_full((x.shape[0], x.shape[1], kh, kw), float("-inf"))
        none = h * w  # larger than every index: "no element of the window on this tile"
        idx = torch.full(vals.shape, none, dtype=torch.long, device=x.device)
        for i, (r0, r1) in enumerate(rows):
            a, b = max(r0, h0) - h0, min(r1, h0 + th) - h0
            for j, (c0, c1) in enumerate(cols):
                c, d = max(c0, w0) - w0, min(c1, w0 + tw) - w0
                if b > a and d > c:
                    # max over a dimension returns the first maximum: row-major in the tile, as in the whole window
                    m, arg = x[:, :, a:b, c:d].flatten(2).max(dim=2)
                    vals[:, :, i, j] = m
                    idx[:, :, i, j] = (arg // (d - c) + a + h0) * w + arg % (d - c) + c + w0
        if group is not None:
            best = vals.clone()
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
            idx = torch.where(vals == best, idx, torch.full_like(idx, none))
            dist.all_reduce(idx, op=dist.ReduceOp.MIN, group=group)
            vals = best
        ctx.shape, ctx.tile = x.shape, (h0, w0, th, tw, w)
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(idx)
        return vals, idx

    @staticmethod
    @once_differentiable  # the forward's collectives are not differentiated again
    def backward(ctx, g, _):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        h0, w0, th, tw, w = ctx.tile
        r, c = idx // w - h0, idx % w - w0
        mine = (r >= 0) & (r < th) & (c >= 0) & (c < tw)
        flat = torch.where(mine, r * tw + c, torch.zeros_like(r)).flatten(2)
        grad = g.new_zeros(ctx.shape[0], ctx.shape[1], th * tw)
        grad.scatter_add_(2, flat, torch.where(mine, g, torch.zeros_like(g)).flatten(2))
        return grad.view(ctx.shape), None, None, None, None


def adaptive_max_pool_tile(x: torch.Tensor, group, extent: tuple[int, int], origin: tuple[int, int],
                           size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.adaptive_max_pool2d(..., return_indices=True)`` of a split activation, replicated on every rank of
    ``group``: each window's maximum over the group, and its index ``h * W + w`` in the input plane (the first
    maximum in row-major order, as the serial kernel; ties across tiles resolve the same way)."""
    return _AdaptiveMax.apply(x, group, extent, origin, size)
