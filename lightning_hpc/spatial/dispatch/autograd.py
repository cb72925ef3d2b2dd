"""Autograd pieces of the gradient convention: the gradient of a tile is that tile's part; the gradient of a
plain (replicated) tensor is complete on every rank.

* :class:`_CompleteGrad`: a replicated value that needs a gradient and meets tiles (a squeeze-and-excitation
  gate, a weight computed by a parametrization) gets that gradient all-reduced over the spatial group;
* :class:`_ScatterTile`: this tile of a replicated whole tensor, its gradient summed over the group
  (:func:`_tile_of`);
* :class:`_Gather`: the whole activation on every rank, backward keeping this tile's part;
* :func:`_replicated_operand`: how a replicated operand joins a tile op (a leaf parameter is recorded in
  :attr:`SpatialGrid.tile_params`, its partial gradient summed by the strategy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import Trace, refuse_trace
from lightning_hpc.spatial.layout.whole import gather_tiles, tile_adjoint
from lightning_hpc.spatial.layout.whole import tile_index as _tile_index


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


class _ScatterTile(torch.autograd.Function):
    """This tile of a replicated whole tensor; backward: the tile's gradient placed in a zero tensor and summed
    over the group (the complete gradient of the replicated tensor)."""

    @staticmethod
    def forward(ctx, x, grid, sdims):  # type: ignore[override]
        refuse_trace('a replicated tensor cut to a tile with its gradient summed')
        ctx.args, ctx.shape = (grid, sdims), x.shape
        return x[_tile_index(x.shape, sdims, grid)].clone()

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, sdims = ctx.args
        return tile_adjoint(g, grid, ctx.shape, sdims), None, None


def _tile_of(t: torch.Tensor, grid: SpatialGrid, sdims: Sequence[int]) -> torch.Tensor:
    """This tile of a replicated whole tensor split along ``sdims``: through :class:`_ScatterTile` when it needs a
    gradient (complete on every rank), else a plain index."""
    if t.requires_grad and grid.group is not None:
        if Trace.active:  # an operator a graph holds, with the same adjoint (graph_ops)
            return torch.ops.lightning_hpc.tile_of(t, key_of(grid), list(sdims))
        return _ScatterTile.apply(t, grid, sdims)
    return t[_tile_index(t.shape, sdims, grid)]


class _Gather(torch.autograd.Function):
    """The whole activation on every rank; backward keeps this tile's part of the (complete) gradient."""

    @staticmethod
    def forward(ctx, local, grid, gshape, sdims):  # type: ignore[override]
        refuse_trace('gathering a split activation whole')
        ctx.args = (grid, tuple(gshape), tuple(sdims))
        return gather_tiles(local, grid, gshape, sdims)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, gshape, sdims = ctx.args
        return g[_tile_index(gshape, sdims, grid)].contiguous(), None, None, None


def _replicated_operand(t: torch.Tensor, grid: SpatialGrid) -> torch.Tensor:
    """A replicated tensor used with tiles: parameters are recorded (partial gradient, summed by the strategy),
    other tensors needing a gradient get it completed over the group."""
    if type(t) is nn.Parameter or isinstance(t, nn.Parameter):  # (the first test: no call for a layer's own)
        grid.tile_params[id(t)] = t
        return t
    if t.requires_grad and grid.group is not None:
        if Trace.active:  # an operator a graph holds, with the same adjoint (graph_ops)
            return torch.ops.lightning_hpc.complete_gradient(t, key_of(grid.group))
        return _CompleteGrad.apply(t, grid.group)
    return t


def _replicated_operands(grid: SpatialGrid, *ts: torch.Tensor | None) -> tuple[Any, ...]:
    """:func:`_replicated_operand` of each tensor (``None``, an absent weight or bias, stays ``None``)."""
    return tuple([None if t is None else _replicated_operand(t, grid) for t in ts])
