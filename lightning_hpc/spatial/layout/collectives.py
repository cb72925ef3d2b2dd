"""Differentiable sum over the spatial group for values used *replicated* afterwards.

A reduction whose result every rank of the group then uses identically needs an all-reduce forward and the
identity backward: each rank already holds the full gradient of the replicated value (section III-B / Table III:
global average pooling feeding a Linear head that every rank evaluates).  The op dispatch uses it for every
reduction over all the split dimensions of a tile (``sum`` / ``mean`` / ``nansum``,
:mod:`lightning_hpc.spatial.dispatch.reductions` and ``dispatch.flat``), for the losses with ``reduction="sum"``
/ ``"mean"`` (``dispatch.losses``) and in adaptive average pooling (:mod:`lightning_hpc.spatial.kernels.adaptive`).
Normalisation layers, whose statistics feed back into every tile, have their own adjoint
(:mod:`lightning_hpc.spatial.kernels.normalization`).  Without a group (one rank holds the whole sample) the value
is returned as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tracing import Trace, refuse_trace

__all__ = ["all_reduce_replicated"]


class _AllReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        refuse_trace('a sum over the group (eager form)')
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    @once_differentiable  # the identity: nothing in this backward needs a derivative of its own
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def all_reduce_replicated(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` into a value every rank then uses identically; gradient passes through unchanged."""
    if group is None:
        return x
    if Trace.active:  # an operator a graph holds, with the same adjoint (graph_ops)
        return torch.ops.lightning_hpc.sum_replicated(x, key_of(group))  # type: ignore[no-any-return]
    return _AllReduceReplicated.apply(x, group)
