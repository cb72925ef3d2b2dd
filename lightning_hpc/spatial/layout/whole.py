"""A whole tensor and its tiles: the index of this rank's tile (:func:`tile_index`), the whole tensor gathered
from every rank's tile (:func:`gather_tiles`) and the complete gradient of a replicated whole tensor from its tiles'
gradients (:func:`tile_adjoint`): the plain moves between a split activation and its replicated whole that the op
dispatch's autograd pieces (:mod:`lightning_hpc.spatial.dispatch.autograd`) and the graph operators of a compiled
split step (:mod:`lightning_hpc.spatial.kernels.graph_ops`) share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.layout.tiling import SpatialGrid

__all__ = ["gather_tiles", "tile_adjoint", "tile_index"]


def tile_index(shape: Sequence[int], sdims: Sequence[int], grid: SpatialGrid) -> tuple:
    """The index selecting this rank's tile of a whole tensor of ``shape`` split along ``sdims``."""
    idx = [slice(None)] * len(shape)
    for d, p, i in zip(sdims, grid.parts, grid.index):
        idx[d] = slice(*block_bounds(shape[d], p)[i])
    return tuple(idx)


def gather_tiles(local: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], sdims: Sequence[int]) -> torch.Tensor:
    """The whole tensor from every rank's tile: tiles padded to the largest tile (all_gather needs one size),
    gathered, and each placed at its bounds.  A grid of one tile holds the whole tensor already (a copy)."""
    if grid.group is None:
        return local.clone()
    k = len(sdims)
    moved = local.movedim(tuple(sdims), tuple(range(-k, 0))).contiguous()
    bounds = [block_bounds(gshape[d], p) for d, p in zip(sdims, grid.parts)]
    largest = [max(b - a for a, b in bs) for bs in bounds]
    pad: list[int] = []
    for j in reversed(range(k)):
        pad += [0, largest[j] - moved.shape[moved.dim() - k + j]]
    padded = F.pad(moved, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in range(grid.size)]
    dist.all_gather(parts, padded, group=grid.group)
    full = moved.new_empty(*moved.shape[:-k], *(gshape[d] for d in sdims))
    for pos, part in enumerate(parts):
        ranges = [bs[i] for bs, i in zip(bounds, grid.unravel(pos))]
        into = (Ellipsis,) + tuple(slice(a, b) for a, b in ranges)
        full[into] = part[(Ellipsis,) + tuple(slice(0, b - a) for a, b in ranges)]
    return full.movedim(tuple(range(-k, 0)), tuple(sdims))


def tile_adjoint(g: torch.Tensor, grid: SpatialGrid, shape: Sequence[int], sdims: Sequence[int]) -> torch.Tensor:
    """The adjoint of cutting this rank's tile out of a replicated whole tensor of ``shape``: the tile's gradient
    ``g`` placed in zeros and summed over the group (the complete gradient of the whole tensor on every rank)."""
    full = g.new_zeros(shape)
    full[tile_index(shape, sdims, grid)] = g
    dist.all_reduce(full, group=grid.group)
    return full
