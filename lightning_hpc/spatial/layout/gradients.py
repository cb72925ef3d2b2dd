"""Gradient reduction of hybrid sample x spatial training (section III-A).

Tile parameters (convolution, batch norm) hold partial sums of Eq. 2 over their tile: the full gradient of a
sample group is their *sum* over the spatial group, and the mini-batch gradient is the *mean* over sample
groups (as in data parallelism).  Replicated parameters (heads after a global pooling) hold the complete
gradient of their sample group on every rank: they are averaged over all ranks.  Both reductions are one
allreduce (sum) over the world after scaling by ``1/S`` and ``1/world`` respectively, flattened into a single
message per dtype.

Which parameters are tile parameters is recorded by the op dispatch while the forward runs, on the grid of the
split tensors (:attr:`~lightning_hpc.spatial.layout.tiling.SpatialGrid.tile_params`); :func:`reduce_model_gradients`
reads that record, for the strategy and for plain-torch training loops alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc.distributed.gradients import allreduce_flat

__all__ = ["reduce_gradients", "reduce_model_gradients"]


def reduce_gradients(
    tile_params: Sequence[torch.nn.Parameter],
    replicated_params: Sequence[torch.nn.Parameter],
    num_sample_groups: int,
    group=None,
) -> None:
    """Sum tile gradients over the spatial group and average them over sample groups; average replicated ones."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    grads: list[torch.Tensor] = []
    scales: list[float] = []
    for params, scale in ((tile_params, 1.0 / num_sample_groups), (replicated_params, 1.0 / world)):
        for p in params:
            if p.grad is not None:
                grads.append(p.grad)
                scales.append(scale)
    allreduce_flat(grads, scales, group=group)


def reduce_model_gradients(model: torch.nn.Module, num_sample_groups: int, tile_params: Mapping[int, Any],
                           group=None) -> None:
    """After backward: reduce the gradients of every parameter of ``model``.  Parameters the op dispatch met on
    tiles (``tile_params``: the grid's record, :attr:`SpatialGrid.tile_params`, since the strategy last cleared it)
    are summed over the spatial group and averaged over sample groups; all others hold their complete gradient and
    are averaged (:func:`reduce_gradients`)."""
    met = tile_params
    tile: list[torch.nn.Parameter] = []
    replicated: list[torch.nn.Parameter] = []
    for p in model.parameters():
        (tile if id(p) in met else replicated).append(p)
    reduce_gradients(tile, replicated, num_sample_groups, group)
