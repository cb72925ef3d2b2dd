"""Redistribution between the spatial and the sample distribution with one all-to-all (section III-C).

Spatial distribution: every rank of the spatial group holds tile ``(i, j)`` of all ``N`` samples.  Sample
distribution: rank ``k`` of the group holds samples ``block_range(N, P, k)`` whole.  Each rank sends every
other rank the part of its tile that rank will own (:math:`I^{(p)}(D_i) \\setminus I^{(p)}(D_j)`) and
receives its new indices; both directions are one ``all_to_all_single`` with uneven splits, and each is the
other's adjoint, so gradients flow back through the opposite shuffle.  Used, for example, to hand a spatially
computed feature map to layers that should run sample-parallel (small spatial extent, section V-C).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.partition import block_bounds, block_range
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["spatial_to_sample", "sample_to_spatial"]


def _tiles(grid: SpatialGrid, h: int, w: int):
    rows, cols = block_bounds(h, grid.parts[0]), block_bounds(w, grid.parts[1])
    return [(rows[k // grid.parts[1]], cols[k % grid.parts[1]]) for k in range(grid.size)]


def _to_sample(x: torch.Tensor, grid: SpatialGrid, n: int, h: int, w: int) -> torch.Tensor:
    p = grid.size
    tiles = _tiles(grid, h, w)
    samples = block_bounds(n, p)
    (r0, r1), (c0, c1) = tiles[grid.local_rank]
    th, tw = r1 - r0, c1 - c0
    send = torch.cat([x[s0:s1].reshape(-1) for (s0, s1) in samples])
    send_splits = [(s1 - s0) * x.shape[1] * th * tw for (s0, s1) in samples]
    m0, m1 = samples[grid.local_rank]
    recv_splits = [(m1 - m0) * x.shape[1] * (b - a) * (d - c) for (a, b), (c, d) in tiles]
    recv = x.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=grid.group)
    out = x.new_empty(m1 - m0, x.shape[1], h, w)
    offset = 0
    for ((a, b), (c, d)), size in zip(tiles, recv_splits):
        out[:, :, a:b, c:d] = recv[offset : offset + size].view(m1 - m0, x.shape[1], b - a, d - c)
        offset += size
    return out


def _to_spatial(x: torch.Tensor, grid: SpatialGrid, n: int, h: int, w: int) -> torch.Tensor:
    p = grid.size
    tiles = _tiles(grid, h, w)
    samples = block_bounds(n, p)
    send = torch.cat([x[:, :, a:b, c:d].reshape(-1) for (a, b), (c, d) in tiles])
    send_splits = [x.shape[0] * x.shape[1] * (b - a) * (d - c) for (a, b), (c, d) in tiles]
    (r0, r1), (c0, c1) = tiles[grid.local_rank]
    recv_splits = [(s1 - s0) * x.shape[1] * (r1 - r0) * (c1 - c0) for (s0, s1) in samples]
    recv = x.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=grid.group)
    return recv.view(n, x.shape[1], r1 - r0, c1 - c0)


class _SpatialToSample(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, n, h, w):  # type: ignore[override]
        ctx.args = (grid, n, h, w)
        return _to_sample(x.contiguous(), grid, n, h, w)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        return _to_spatial(g.contiguous(), *ctx.args), None, None, None, None


class _SampleToSpatial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, n, h, w):  # type: ignore[override]
        ctx.args = (grid, n, h, w)
        return _to_spatial(x.contiguous(), grid, n, h, w)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        return _to_sample(g.contiguous(), *ctx.args), None, None, None, None


def spatial_to_sample(x_tile: torch.Tensor, grid: SpatialGrid) -> torch.Tensor:
    """Tiles of ``N`` samples -> whole samples ``block_range(N, P, k)`` on group rank ``k`` (needs ``N >= P``)."""
    n = x_tile.shape[0]
    if n < grid.size:
        raise ValueError(
            f"spatial_to_sample: {n} samples cannot be spread over {grid.size} ranks; use a batch of at least "
            f"{grid.size}"
        )
    if grid.size == 1:
        return x_tile
    h, w = grid.global_extent(x_tile.shape[-2], x_tile.shape[-1], device=x_tile.device)
    return _SpatialToSample.apply(x_tile, grid, n, h, w)


def sample_to_spatial(x_samples: torch.Tensor, grid: SpatialGrid, n: int) -> torch.Tensor:
    """Inverse of :func:`spatial_to_sample`: whole samples (``n`` in the group) -> this rank's tile of all ``n``."""
    if grid.size == 1:
        return x_samples
    s0, s1 = block_range(n, grid.size, grid.local_rank)
    if x_samples.shape[0] != s1 - s0:
        raise ValueError(f"sample_to_spatial: rank holds {x_samples.shape[0]} samples, expected {s1 - s0} of {n}")
    return _SampleToSpatial.apply(x_samples, grid, n, x_samples.shape[-2], x_samples.shape[-1])
