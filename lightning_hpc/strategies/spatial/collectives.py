"""Differentiable reductions over the spatial group.

Two adjoints are needed (section III-B): statistics that feed back into every tile (aggregated batch norm)
use :func:`all_reduce_sum`, whose backward is again an allreduce (every tile's output depends on every tile's
input); a global reduction whose result is then used *replicated* (global average pooling feeding a Linear
head that every rank evaluates identically) uses :func:`all_reduce_replicated`, whose backward is the
identity (each rank already holds the full gradient of the replicated value).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "all_reduce_replicated"]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        g = grad.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _AllReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group``; gradient = sum of the group's gradients.  No-op without a group."""
    return x if group is None else _AllReduceSum.apply(x, group)


def all_reduce_replicated(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` into a value every rank then uses identically; gradient passes through unchanged."""
    return x if group is None else _AllReduceReplicated.apply(x, group)
