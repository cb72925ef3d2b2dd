"""Differentiable reduction over the spatial group for values used *replicated* afterwards.

A global reduction whose result every rank of the group then uses identically (global average pooling feeding
a Linear head that every rank evaluates, section III-B / Table III) needs an allreduce forward and the
identity backward: each rank already holds the full gradient of the replicated value.  (Aggregated batch norm,
whose statistics feed back into every tile, has its own adjoint in :mod:`batchnorm`.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["all_reduce_replicated"]


class _AllReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def all_reduce_replicated(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` into a value every rank then uses identically; gradient passes through unchanged."""
    return x if group is None else _AllReduceReplicated.apply(x, group)
