"""Gradient-norm clipping when some parameters are sharded over ranks (model parallelism).

``torch.nn.utils.clip_grad_norm_`` on a rank sees the replicated parameters and only this rank's shards, so each
rank would clip by a different norm and the replicas drift apart.  The norm of the whole model counts every
replicated gradient once and every shard once:

    ||g||_p^p = sum_replicated |g|^p + sum over ranks of (sum_local shards |g|^p)      (p = inf: max)

and every rank scales its gradients by the same ``max_norm / (||g|| + 1e-6)`` (clamped at 1), as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from lightning_hpc.distributed.partitioned import local_block

__all__ = ["global_grad_norm", "clip_grad_norm_", "clip_by_global_norm"]


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    # plain blocks: the norm of the whole model is reduced here, once (a block parameter's own norm is already
    # its whole tensor's, which the all-reduce below would count K times)
    return [local_block(p.grad) for p in params if p.grad is not None]


def _local_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().to(torch.float64) for g in grads]).max()
    return torch.stack(
        [torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float64) ** norm_type for g in grads]
    ).sum()


@torch.no_grad()
def global_grad_norm(
    replicated: Iterable[torch.Tensor],
    sharded: Iterable[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The ``norm_type``-norm of the gradient of the whole model (float64 scalar, equal on every rank)."""
    rep, shard = _grads(replicated), _grads(sharded)
    device = (rep or shard or [torch.zeros(())])[0].device
    local = _local_power(shard, norm_type, device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=group)
    mine = _local_power(rep, norm_type, device)
    if math.isinf(norm_type):
        return torch.maximum(local, mine)
    return (local + mine) ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    replicated: Iterable[torch.Tensor],
    sharded: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale every gradient so the whole model's gradient norm is at most ``max_norm``; returns the norm."""
    rep, shard = list(replicated), list(sharded)
    total = global_grad_norm(rep, shard, group, norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in _grads(rep) + _grads(shard):
        g.mul_(coef.to(g.dtype))
    return total


def clip_by_global_norm(
    sharded: Callable[[], Iterable[torch.Tensor]],
    group: Callable[[], dist.ProcessGroup | None] = lambda: None,
) -> Callable[[torch.optim.Optimizer, float], None]:
    """A drop-in for a Lightning precision plugin's ``clip_grad_by_norm(optimizer, clip_val)`` under model
    parallelism: the optimizer's parameters that ``sharded()`` lists are shards over ``group()``, the others are
    replicated.  Every model-parallel strategy installs it the same way in its ``setup``."""

    def clip(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        shard_ids = {id(p) for p in sharded()}
        clip_grad_norm_(
            [p for p in params if id(p) not in shard_ids],
            [p for p in params if id(p) in shard_ids],
            float(clip_val),
            group(),
        )

    return clip
