"""Helpers shared by the multi-process K-FAC tests."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def average_gradients_like_ddp(model: nn.Module) -> None:
    """What the strategy does before K-FAC runs (DDP's gradient allreduce): every gradient averaged over the
    world, in place."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
