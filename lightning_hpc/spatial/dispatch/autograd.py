"""Autograd pieces of the gradient convention: the gradient of a tile is that tile's part; the gradient of a
plain (replicated) tensor is complete on every rank.

* :class:`_CompleteGrad`: a replicated value that needs a gradient and meets tiles (a squeeze-and-excitation
  gate, a weight computed by a parametrization) gets that gradient all-reduced over the spatial group;
* :class:`_ScatterTile`: this tile of a replicated whole tensor, its gradient summed over the group;
* :class:`_Gather`: the whole activation on every rank, backward keeping this tile's part;
* :func:`_replicated_operand`: how a replicated operand joins a tile op (a leaf parameter is recorded in
  :attr:`DispatchState.tile_params`, its partial gradient summed by the strategy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.dispatch.state import _STATE
from lightning_hpc.spatial.tiling import SpatialGrid


class _CompleteGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the spatial group (a replicated value that met tiles
    received only this tile's part of its gradient)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _tile_index(shape: Sequence[int], hdim: int, wdim: int, grid: SpatialGrid) -> tuple:
    (h0, h1) = block_bounds(shape[hdim], grid.parts[0])[grid.index[0]]
    (w0, w1) = block_bounds(shape[wdim], grid.parts[1])[grid.index[1]]
    idx = [slice(None)] * len(shape)
    idx[hdim], idx[wdim] = slice(h0, h1), slice(w0, w1)
    return tuple(idx)


class _ScatterTile(torch.autograd.Function):
    """This tile of a replicated whole tensor; backward: the tile's gradient placed in a zero tensor and summed
    over the group (the complete gradient of the replicated tensor)."""

    @staticmethod
    def forward(ctx, x, grid, hdim, wdim):  # type: ignore[override]
        ctx.args, ctx.shape = (grid, hdim, wdim), x.shape
        return x[_tile_index(x.shape, hdim, wdim, grid)].clone()

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, hdim, wdim = ctx.args
        full = g.new_zeros(ctx.shape)
        full[_tile_index(ctx.shape, hdim, wdim, grid)] = g
        dist.all_reduce(full, group=grid.group)
        return full, None, None, None


def _gather_raw(local: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], hdim: int, wdim: int) -> torch.Tensor:
    moved = local.movedim((hdim, wdim), (-2, -1)).contiguous()
    rows, cols = block_bounds(gshape[hdim], grid.parts[0]), block_bounds(gshape[wdim], grid.parts[1])
    mh, mw = max(b - a for a, b in rows), max(b - a for a, b in cols)
    padded = F.pad(moved, (0, mw - moved.shape[-1], 0, mh - moved.shape[-2])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(grid.size)]
    dist.all_gather(parts, padded, group=grid.group)
    full = moved.new_empty(*moved.shape[:-2], gshape[hdim], gshape[wdim])
    for k, part in enumerate(parts):
        (a, b), (c, d) = rows[k // grid.parts[1]], cols[k % grid.parts[1]]
        full[..., a:b, c:d] = part[..., : b - a, : d - c]
    return full.movedim((-2, -1), (hdim, wdim))


class _Gather(torch.autograd.Function):
    """The whole activation on every rank; backward keeps this tile's part of the (complete) gradient."""

    @staticmethod
    def forward(ctx, local, grid, gshape, hdim, wdim):  # type: ignore[override]
        ctx.args = (grid, tuple(gshape), hdim, wdim)
        return _gather_raw(local, grid, gshape, hdim, wdim)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, gshape, hdim, wdim = ctx.args
        return g[_tile_index(gshape, hdim, wdim, grid)].contiguous(), None, None, None, None


def _replicated_operand(t: torch.Tensor, grid: SpatialGrid) -> torch.Tensor:
    """A replicated tensor used with tiles: parameters are recorded (partial gradient, summed by the strategy),
    other tensors needing a gradient get it completed over the group."""
    if isinstance(t, nn.Parameter):
        _STATE.tile_params[id(t)] = t
        return t
    if t.requires_grad and grid.group is not None:
        return _CompleteGrad.apply(t, grid.group)
    return t
