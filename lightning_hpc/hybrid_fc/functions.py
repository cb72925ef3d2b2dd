"""Autograd functions for the collectives between the sharded head's layers and towards the examples' owners.

Conventions (see ``layout.py``): ``S`` is a block of neurons for all n examples of the sub-batch (exact values,
exact gradients); ``P`` is a partial sum of a full-width output (the exact value is the sum over ranks, its
gradient is replicated); a replicated input ``R`` carries *partial* gradients (each rank's shard contributes
its share, the exact gradient is their sum).  Every function's backward is the adjoint of its forward:
all-gather <-> reduce-scatter, all-to-all <-> reverse all-to-all, gather <-> scatter, reduce <-> broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Function

from lightning_hpc.hybrid_fc.collectives import HeadComm

__all__ = [
    "gather_neurons",
    "reduce_scatter_neurons",
    "rows_to_owners_from_col",
    "rows_to_owners_from_row",
    "to_root_from_col",
    "to_root_from_row",
    "scale_grad",
    "round_to",
]


class _GatherNeurons(Function):
    """S -> R: all-gather neuron blocks; backward reduce-scatters the partial gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: HeadComm, sizes: Sequence[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.sizes = comm, list(sizes)
        return comm.all_gather(x, sizes, dim=1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.comm.reduce_scatter(g, ctx.sizes, dim=1), None, None


class _ReduceScatter(Function):
    """Reduce-scatter partial sums into blocks of ``sizes`` along ``dim``; backward all-gathers the exact
    gradients.  dim 1: P -> S between head layers (neuron blocks); dim 0: a row-blocked sub-batch's partial
    logits to the rows' owners."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, comm: HeadComm, sizes: Sequence[int], dim: int
    ) -> torch.Tensor:
        ctx.comm, ctx.sizes, ctx.dim = comm, list(sizes), dim
        return comm.reduce_scatter(x, sizes, dim=dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.comm.all_gather(g.contiguous(), ctx.sizes, dim=ctx.dim), None, None, None


class _RowsToOwnersFromCol(Function):
    """Class-sharded logits (n, C/K) of a row-blocked sub-batch -> each owner's rows with all classes."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, comm: HeadComm, row_sizes: Sequence[int], class_sizes: Sequence[int]
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.row_sizes, ctx.class_sizes = comm, list(row_sizes), list(class_sizes)
        return comm.all_to_all(x, 0, row_sizes, 1, class_sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.comm.all_to_all(g.contiguous(), 1, ctx.class_sizes, 0, ctx.row_sizes), None, None, None


class _ToRootFromCol(Function):
    """Scheme b: class blocks of the sub-batch owned by ``root`` are gathered there; others get (0, C)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, comm: HeadComm, class_sizes: Sequence[int], root: int
    ) -> torch.Tensor:
        ctx.comm, ctx.class_sizes, ctx.root, ctx.rows = comm, list(class_sizes), root, x.shape[0]
        ctx.like = x
        return comm.gather_columns(x, class_sizes, root)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        comm = ctx.comm
        src = g.contiguous() if comm.rank == ctx.root else None
        return comm.scatter_columns(src, ctx.class_sizes, ctx.rows, ctx.root, ctx.like), None, None, None


class _ToRootFromRow(Function):
    """Scheme b: partial sums (n, C) reduced onto ``root``; backward broadcasts the root's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: HeadComm, root: int) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.root, ctx.shape = comm, root, x.shape
        out = comm.reduce(x, root)
        return out if comm.rank == root else x.new_empty((0, x.shape[1]))

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        comm = ctx.comm
        buf = g.contiguous().clone() if comm.rank == ctx.root else g.new_empty(ctx.shape)
        return comm.broadcast(buf, ctx.root), None, None


class _ScaleGrad(Function):
    """Identity forward, gradient times ``scale`` (head shards under fc_update="per_step" see the gradients of
    all K ranks' local mean losses; 1/K turns their sum into the gradient of the mean over K x b examples)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g * ctx.scale, None


def gather_neurons(x: torch.Tensor, comm: HeadComm, sizes: Sequence[int]) -> torch.Tensor:
    return _GatherNeurons.apply(x, comm, sizes)


def reduce_scatter_neurons(x: torch.Tensor, comm: HeadComm, sizes: Sequence[int]) -> torch.Tensor:
    return _ReduceScatter.apply(x, comm, sizes, 1)


def rows_to_owners_from_col(
    x: torch.Tensor, comm: HeadComm, row_sizes: Sequence[int], class_sizes: Sequence[int]
) -> torch.Tensor:
    return _RowsToOwnersFromCol.apply(x, comm, row_sizes, class_sizes)


def rows_to_owners_from_row(x: torch.Tensor, comm: HeadComm, row_sizes: Sequence[int]) -> torch.Tensor:
    return _ReduceScatter.apply(x, comm, row_sizes, 0)


def to_root_from_col(x: torch.Tensor, comm: HeadComm, class_sizes: Sequence[int], root: int) -> torch.Tensor:
    return _ToRootFromCol.apply(x, comm, class_sizes, root)


def to_root_from_row(x: torch.Tensor, comm: HeadComm, root: int) -> torch.Tensor:
    return _ToRootFromRow.apply(x, comm, root)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _Round(Function):
    """Round to ``dtype``'s precision, keeping the tensor's dtype; with ``grad`` the gradient too (else the
    gradient passes unchanged).  The sharded head's emulation of one process's autocast (see
    ``HybridHead._autocast_dtype``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, grad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype, ctx.grad = dtype, grad
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return (g.to(ctx.dtype).to(g.dtype) if ctx.grad else g), None, None


def round_to(x: torch.Tensor, dtype: torch.dtype | None, grad: bool = False) -> torch.Tensor:
    """``x``'s values rounded to ``dtype`` (``None``: unchanged); ``grad``: its gradient rounded as well."""
    return x if dtype is None else _Round.apply(x, dtype, grad)
