"""Adaptive average and max pooling (``F.adaptive_avg_pool1d/2d/3d``, ``F.adaptive_max_pool1d/2d/3d``) of a tile
split over 1, 2 or 3 spatial dimensions, to any output size (Dryden et al., section III-B: a global pooling
reduces over the spatial group and leaves a replicated result, Table III).

Output ``i`` of extent ``m`` along a dimension of extent ``n`` pools the input window
``[floor(i*n/m), ceil((i+1)*n/m))`` (:func:`adaptive_windows`, torch's ``start_index`` / ``end_index``); a window
may straddle tiles.  Each rank computes the partial window sums (or maxima) over its own tile, the group combines
them (sum, or max with the index of the first maximum), and every rank holds the whole output.  No halo.

Gradients: every rank holds the whole (replicated) output gradient; the average passes it through the partial
sums (the all-reduce's backward is the identity,
:func:`lightning_hpc.spatial.layout.collectives.all_reduce_replicated`), the maximum adds it at the indices this
tile owns.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.kernels.plan import check_tile
from lightning_hpc.spatial.layout.collectives import all_reduce_replicated
from lightning_hpc.spatial.layout.halo_exchange import trailing
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import refuse_trace

__all__ = ["adaptive_windows", "adaptive_output_size", "adaptive_avg_pool", "adaptive_max_pool"]

Range = tuple[int, int]


def adaptive_windows(n: int, m: int) -> list[Range]:
    """The input window ``[start, end)`` of each of the ``m`` outputs over an extent ``n`` (torch's adaptive
    pooling: ``start = floor(i*n/m)``, ``end = ceil((i+1)*n/m)``)."""
    return [(i * n // m, -(-(i + 1) * n // m)) for i in range(m)]


def adaptive_output_size(output_size: Any, extents: Sequence[int]) -> tuple[int, ...]:
    """torch's ``output_size`` argument (an int, or one entry per dimension, ``None`` keeping the input's extent)
    as ints."""
    k = len(extents)
    if isinstance(output_size, int):
        return (output_size,) * k
    sizes = tuple(output_size)
    if len(sizes) != k:
        raise ValueError(f"adaptive pooling: output_size={output_size!r} for {k} spatial dimensions")
    return tuple(int(n) if s is None else int(s) for s, n in zip(sizes, extents))


@functools.lru_cache(maxsize=256)
def _selection(n: int, m: int, lo: int, hi: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``m x (hi - lo)`` 0/1 matrix of which of the tile's entries ``[lo, hi)`` fall in each of the ``m``
    windows over ``n``, and each window's size.  Made once per distinct call (cached): made from host lists on
    every call, the bounds and sizes would be uploads per call (on a GPU, waits for the queue)."""
    windows = adaptive_windows(n, m)
    bounds = torch.tensor(windows).to(device)
    idx = torch.arange(lo, hi, device=device)
    sel = ((idx[None, :] >= bounds[:, :1]) & (idx[None, :] < bounds[:, 1:])).to(dtype)
    return sel, torch.tensor([b - a for a, b in windows], dtype=dtype).to(device)


class _AdaptiveMax(torch.autograd.Function):
    """Window maxima over the spatial group and the global flat index (row-major over the split dimensions) of
    the first maximum of each window, where the serial kernel puts a tie's gradient; backward adds the
    (replicated) output gradient at the indices this tile owns.  One reduction per output cell that meets the
    tile (a loop: meant for the small outputs of global poolings)."""

    @staticmethod
    def forward(ctx, x, group, extents, origin, size):  # type: ignore[override]
        refuse_trace('adaptive max pooling over split dimensions')
        k = len(extents)
        tile = tuple(x.shape[-k:])
        lead = tuple(x.shape[:-k])
        vals = x.new_full((*lead, *size), float("-inf"))
        none = math.prod(extents)  # larger than every index: "no entry of the window on this tile"
        idx = torch.full(vals.shape, none, dtype=torch.long, device=x.device)
        windows = [adaptive_windows(n, m) for n, m in zip(extents, size)]
        strides = [math.prod(extents[e + 1 :]) for e in range(k)]  # of the global flat index
        for cell in itertools.product(*(range(m) for m in size)):
            cut = [(max(a, o) - o, min(b, o + t) - o) for (a, b), o, t in
                   ((windows[e][c], origin[e], tile[e]) for e, c in enumerate(cell))]
            if any(b <= a for a, b in cut):
                continue
            block = x[trailing(slice(a, b) for a, b in cut)]
            # max over one flattened dimension returns the first maximum: row-major in the tile's part of the window,
            # which is the window's own row-major order
            m, arg = block.flatten(-k).max(dim=-1)
            flat = torch.zeros_like(arg)
            for e in reversed(range(k)):
                ext = cut[e][1] - cut[e][0]
                arg, r = arg // ext, arg % ext
                flat += (r + cut[e][0] + origin[e]) * strides[e]
            at = trailing(cell)
            vals[at] = m
            idx[at] = flat
        if group is not None:
            best = vals.clone()
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
            idx = torch.where(vals == best, idx, torch.full_like(idx, none))
            dist.all_reduce(idx, op=dist.ReduceOp.MIN, group=group)
            vals = best
        ctx.shape, ctx.extents, ctx.origin = x.shape, tuple(extents), tuple(origin)
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(idx)
        return vals, idx

    @staticmethod
    @once_differentiable  # the forward's collectives are not differentiated again
    def backward(ctx, g, _):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        extents, origin = ctx.extents, ctx.origin
        k = len(extents)
        tile = ctx.shape[-k:]
        rest, local, mine = idx, torch.zeros_like(idx), torch.ones_like(idx, dtype=torch.bool)
        for e in reversed(range(k)):
            rest, r = rest // extents[e], rest % extents[e]
            r = r - origin[e]
            mine &= (r >= 0) & (r < tile[e])
            local += r * math.prod(tile[e + 1 :])
        flat = torch.where(mine, local, torch.zeros_like(local)).flatten(-k)
        grad = g.new_zeros(*ctx.shape[:-k], math.prod(tile))
        grad.scatter_add_(-1, flat, torch.where(mine, g, torch.zeros_like(g)).flatten(-k))
        return grad.view(ctx.shape), None, None, None, None


def _origin(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], op: str) -> tuple[int, ...]:
    check_tile(x, grid, extents, op)
    return tuple(lo for lo, _ in grid.tile_bounds(*extents))


def adaptive_avg_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], output_size: Any) -> torch.Tensor:
    """``F.adaptive_avg_pool{k}d(x_global, output_size)``, the whole output replicated on every rank of the grid
    (``x``: this rank's tile of a sample whose split dimensions have global ``extents``)."""
    size = adaptive_output_size(output_size, extents)
    origin = _origin(x, grid, extents, f"adaptive_avg_pool{grid.ndim}d")
    # each window's sum over this tile, summed over the group and divided by the window's size
    k = len(extents)
    # float32 sums for reduced-precision inputs, as the serial kernel accumulates them
    cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    part = x.to(cdt)
    counts = torch.ones((), dtype=cdt, device=x.device)
    with torch.autocast(x.device.type, enabled=False):  # autocast would run the sums as a bf16 matrix product
        for e, (n, o, m) in enumerate(zip(extents, origin, size)):
            dim = x.dim() - k + e
            sel, sizes = _selection(n, m, o, o + x.shape[dim], cdt, x.device)
            part = (part.movedim(dim, -1) @ sel.T).movedim(-1, dim)
            counts = counts * sizes.view([-1 if j == e else 1 for j in range(k)])
    return (all_reduce_replicated(part, grid.group) / counts).to(x.dtype)


def adaptive_max_pool(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], output_size: Any,
                      return_indices: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.adaptive_max_pool{k}d(x_global, output_size, return_indices)``, replicated on every rank of the grid;
    the indices are the serial op's (into the flattened global split dimensions)."""
    size = adaptive_output_size(output_size, extents)
    origin = _origin(x, grid, extents, f"adaptive_max_pool{grid.ndim}d")
    vals, idx = _AdaptiveMax.apply(x, grid.group, tuple(extents), origin, tuple(size))
    return (vals, idx) if return_indices else vals
