"""The spatial process grid: which rank holds which tile of H x W (Dryden et al., section III-A).

A spatial group of ``ph * pw`` ranks holds one (micro-batch of) sample(s); rank ``k`` of the group holds tile
``(k // pw, k % pw)``, i.e. tile rows follow H and tile columns follow W, both blocked with
:func:`lightning_hpc.distributed.partition.block_bounds` (uneven tiles allowed: the first ``n % p`` blocks are
one larger).  Every activation of a converted model keeps this blocked layout of its own global extent, so a
layer can work out every tile's bounds from the global size alone.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc.distributed.groups import MeshDim, build_mesh, default_timeout
from lightning_hpc.distributed.partition import block_bounds

__all__ = ["SpatialGrid", "HybridLayout", "create_hybrid_layout", "tile_slices", "parse_parts"]


def parse_parts(parts: Any, *, setting: str = "spatial_parts") -> tuple[int, int]:
    """``(ph, pw)`` from a pair (list, tuple, ListConfig) of positive ints; clear error otherwise."""
    try:
        ph, pw = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"{setting}={parts!r}: expected a pair (ph, pw) of positive integers, e.g. (2, 1)") from None
    if ph < 1 or pw < 1:
        raise ValueError(f"{setting}=({ph}, {pw}): both parts must be >= 1")
    return ph, pw


@dataclass
class SpatialGrid:
    """One spatial group: its ``parts = (ph, pw)``, its process group and the global ranks in tile order.

    ``group`` is ``None`` only for the trivial 1 x 1 grid (no communication at all), which lets converted
    layers run in a single process without torch.distributed.
    """

    parts: tuple[int, int]
    ranks: list[int]
    group: dist.ProcessGroup | None
    local_rank: int
    _uid: int = field(default=0, repr=False)

    @classmethod
    def single(cls) -> SpatialGrid:
        return cls(parts=(1, 1), ranks=[dist.get_rank() if dist.is_initialized() else 0], group=None, local_rank=0)

    @property
    def size(self) -> int:
        return self.parts[0] * self.parts[1]

    @property
    def index(self) -> tuple[int, int]:
        """This rank's tile (row along H, column along W)."""
        return divmod(self.local_rank, self.parts[1])

    def global_rank(self, i: int, j: int) -> int:
        return self.ranks[i * self.parts[1] + j]

    def neighbor(self, di: int, dj: int) -> int | None:
        """Global rank of the tile ``(i + di, j + dj)``, or ``None`` outside the grid (no periodic wrap)."""
        i, j = self.index
        if 0 <= i + di < self.parts[0] and 0 <= j + dj < self.parts[1]:
            return self.global_rank(i + di, j + dj)
        return None

    def next_tag(self) -> int:
        """A fresh message tag per halo exchange, so concurrent exchanges of different layers never match."""
        self._uid = (self._uid + 1) % (1 << 20)
        return self._uid * 16

    def global_extent(self, local_h: int, local_w: int, device: torch.device | None = None) -> tuple[int, int]:
        """Global (H, W) of a tiled tensor from the local tile sizes: H sums the tile heights of one tile column,
        W the tile widths of one tile row (one 2-int allreduce over the group)."""
        if self.group is None or self.size == 1:
            return local_h, local_w
        i, j = self.index
        t = torch.tensor([local_h if j == 0 else 0, local_w if i == 0 else 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=self.group)
        return int(t[0]), int(t[1])

    def tile_bounds(
        self, h: int, w: int, index: tuple[int, int] | None = None
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((h0, h1), (w0, w1))`` of tile ``index`` (default: this rank's) of an ``h x w`` extent."""
        i, j = self.index if index is None else index
        return block_bounds(h, self.parts[0])[i], block_bounds(w, self.parts[1])[j]


def tile_slices(h: int, w: int, parts: tuple[int, int], index: tuple[int, int]) -> tuple[slice, slice]:
    """Slices of H and W selecting tile ``index`` (what a data module reads for ``set_spatial_tile``)."""
    (h0, h1) = block_bounds(h, parts[0])[index[0]]
    (w0, w1) = block_bounds(w, parts[1])[index[1]]
    return slice(h0, h1), slice(w0, w1)


@dataclass
class HybridLayout:
    """Hybrid sample x spatial layout (section III-A): ``num_sample_groups`` groups of ``ph * pw`` contiguous
    ranks; this rank is in sample group ``sample_index`` and holds tile ``grid.index`` of that group's samples.
    ``replica_group`` joins the ranks that hold the same tile in every sample group (a value replicated over a
    spatial group is counted once when reduced over it); ``None`` outside torch.distributed."""

    grid: SpatialGrid
    num_sample_groups: int
    sample_index: int
    replica_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.num_sample_groups * self.grid.size


def create_hybrid_layout(parts: tuple[int, int], timeout: datetime.timedelta | None = None,
                         device_type: str = "cpu") -> HybridLayout:
    """Split the world into sample groups of ``ph * pw`` contiguous ranks (contiguous ranks share a node, so
    halo exchanges stay on-node where possible): a ``("sample", "tile")`` DeviceMesh whose groups inherit
    ``timeout`` (by default the world's).  Must be called by every rank."""
    ph, pw = parts
    size = ph * pw
    if not dist.is_initialized():
        if size != 1:
            raise RuntimeError(
                f"spatial_parts={parts} needs torch.distributed to be initialised with {size} ranks per sample"
            )
        return HybridLayout(SpatialGrid.single(), 1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    tile = MeshDim("tile", size, setting=f"spatial_parts={ph}x{pw}={size}", what="ranks per sample")
    dims = [MeshDim("sample"), tile]
    mesh = build_mesh(dims, device_type=device_type, timeout=timeout or default_timeout())
    group = mesh.get_group("tile") if size > 1 else None
    grid = SpatialGrid(parts=(ph, pw), ranks=[int(r) for r in mesh["tile"].mesh.tolist()], group=group,
                       local_rank=rank % size)
    return HybridLayout(grid=grid, num_sample_groups=world // size, sample_index=rank // size,
                        replica_group=mesh.get_group("sample"))
