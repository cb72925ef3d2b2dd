"""The spatial process grid: which rank holds which tile of a 1-, 2- or 3-D sample (Dryden et al., section III-A;
section I: "spatial parallelism ... can be easily extended to 3D").

A spatial group of ``prod(parts)`` ranks holds one (micro-batch of) sample(s), split along its last
``len(parts)`` dimensions (L; H, W; or D, H, W); rank ``k`` of the group holds the tile whose index is ``k``
unravelled row-major over ``parts`` (for images: tile rows follow H, tile columns W), each dimension blocked with
:func:`lightning_hpc.distributed.partition.block_bounds` (uneven tiles allowed: the first ``n % p`` blocks are
one larger).  Every split activation keeps this blocked layout of its own global extent, so a kernel can work
out every tile's bounds from the global size alone.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_hpc.distributed.groups import MeshDim, build_mesh, default_timeout
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.layout.decisions import DecisionCache
from lightning_hpc.spatial.layout.policy import DispatchPolicy

if TYPE_CHECKING:
    from lightning_hpc.spatial.dispatch.kfac_contract import TiledLayerRegistry
    from lightning_hpc.spatial.dispatch.state import ModuleTrace

__all__ = ["SpatialGrid", "HybridLayout", "create_hybrid_layout", "tile_slices", "parse_parts", "parts_text"]


def parse_parts(parts: Any, *, setting: str = "spatial_parts") -> tuple[int, ...]:
    """The parts of each split spatial dimension, from a sequence (list, tuple, ListConfig) of 1 to 3 positive ints:
    ``(pl,)`` for ``N x C x L``, ``(ph, pw)`` for ``N x C x H x W``, ``(pd, ph, pw)`` for ``N x C x D x H x W``; a
    clear error otherwise."""
    try:
        out = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"{setting}={parts!r}: expected the parts of each spatial dimension as 1 to 3 positive integers, e.g. "
            f"(2, 1) for images or (2, 1, 1) for volumes"
        ) from None
    if not 1 <= len(out) <= 3:
        raise ValueError(f"{setting}={parts!r}: 1, 2 or 3 spatial dimensions (L; H, W; D, H, W), not {len(out)}")
    if any(p < 1 for p in out):
        raise ValueError(f"{setting}={out}: every part must be >= 1")
    return out


def parts_text(parts: Sequence[int]) -> str:
    """``2x2x1``: a split as messages write it."""
    return "x".join(str(p) for p in parts)


@dataclass
class SpatialGrid:
    """One spatial group: ``parts`` (one entry per split spatial dimension, in the tensor's order), its process
    group and the global ranks in tile order (row-major over ``parts``: the last dimension varies fastest).

    ``group`` is ``None`` only for the trivial grid of one tile (no communication at all), which lets the tile
    kernels run in a single process without torch.distributed.
    """

    parts: tuple[int, ...]
    ranks: list[int]
    group: dist.ProcessGroup | None
    local_rank: int
    _uid: int = field(default=0, repr=False)
    #: the op dispatch's decisions for split tensors on this grid (:mod:`lightning_hpc.spatial.layout.decisions`)
    decisions: DecisionCache = field(default_factory=DecisionCache, repr=False, compare=False)
    #: the strategy's settings for the op dispatch on this grid's split tensors
    policy: DispatchPolicy = field(default_factory=DispatchPolicy, repr=False, compare=False)
    #: the leaf parameters met on this grid's tiles since the strategy last cleared it (by ``id``): their gradients
    #: are partial sums over the tiles, which the strategy sums over the spatial group
    tile_params: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    #: the convolutions K-FAC captures on this grid's tiles (the strategy's
    #: :class:`~lightning_hpc.spatial.dispatch.kfac_contract.TiledLayerRegistry`; None: no K-FAC record)
    tiled_layers: TiledLayerRegistry | None = field(default=None, repr=False, compare=False)
    #: the gathers already warned about on this grid (op, module), each warned once per run
    warned: set[tuple[str, str]] = field(default_factory=set, repr=False, compare=False)
    #: the modules of the run that owns this grid running now (the strategy's, kept by its hooks), for messages
    modules: ModuleTrace | None = field(default=None, repr=False, compare=False)

    @classmethod
    def single(cls, ndim: int = 2) -> SpatialGrid:
        return cls(parts=(1,) * ndim, ranks=[dist.get_rank() if dist.is_initialized() else 0], group=None,
                   local_rank=0)

    @property
    def ndim(self) -> int:
        """The number of spatial dimensions the grid blocks (some may have one part)."""
        return len(self.parts)

    @property
    def size(self) -> int:
        return math.prod(self.parts)

    @property
    def index(self) -> tuple[int, ...]:
        """This rank's tile: its block index along each spatial dimension."""
        return self.unravel(self.local_rank)

    def unravel(self, k: int) -> tuple[int, ...]:
        """The tile index of position ``k`` in the group (row-major)."""
        out = []
        for p in reversed(self.parts):
            k, r = divmod(k, p)
            out.append(r)
        return tuple(reversed(out))

    def position(self, *index: int) -> int:
        """The position in the group of tile ``index`` (row-major)."""
        k = 0
        for i, p in zip(index, self.parts):
            k = k * p + i
        return k

    def global_rank(self, *index: int) -> int:
        return self.ranks[self.position(*index)]

    def neighbor(self, *delta: int) -> int | None:
        """Global rank of the tile ``index + delta``, or ``None`` outside the grid (no periodic wrap)."""
        idx = tuple(i + d for i, d in zip(self.index, delta))
        if all(0 <= i < p for i, p in zip(idx, self.parts)):
            return self.global_rank(*idx)
        return None

    def next_tag(self) -> int:
        """A fresh message tag base per exchange, so concurrent exchanges of different layers never match (room
        for the 3^3 directions of a 3-D exchange, forward and backward)."""
        self._uid = (self._uid + 1) % (1 << 18)
        return self._uid * 64

    def tile_bounds(self, *extent: int, index: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
        """``((lo, hi), ...)`` of tile ``index`` (default: this rank's) along each split dimension of the given
        global extents."""
        idx = self.index if index is None else tuple(index)
        return tuple(block_bounds(n, p)[i] for n, p, i in zip(extent, self.parts, idx))


def tile_slices(extent: Sequence[int], parts: Sequence[int], index: Sequence[int]) -> tuple[slice, ...]:
    """Slices of the split dimensions (the last ``len(parts)`` of a sample) selecting tile ``index``: what a data
    module reads for ``set_spatial_tile``: ``x[(Ellipsis,) + tile_slices(x.shape[-2:], parts, index)]`` cuts an
    image."""
    if not len(extent) == len(parts) == len(index):
        raise ValueError(f"tile_slices: extent {tuple(extent)}, parts {tuple(parts)} and index {tuple(index)} must "
                         f"have one entry per split dimension")
    return tuple(slice(*block_bounds(int(n), int(p))[int(i)]) for n, p, i in zip(extent, parts, index))


@dataclass
class HybridLayout:
    """Hybrid sample x spatial layout (section III-A): ``num_sample_groups`` groups of ``prod(parts)`` contiguous
    ranks; this rank is in sample group ``sample_index`` and holds tile ``grid.index`` of that group's samples.
    ``replica_group`` joins the ranks that hold the same tile in every sample group (a value replicated over a
    spatial group is counted once when reduced over it); ``None`` outside torch.distributed."""

    grid: SpatialGrid
    num_sample_groups: int
    sample_index: int
    replica_group: dist.ProcessGroup | None = None
    #: the ``("sample", "tile")`` DeviceMesh the groups come from (``None`` outside torch.distributed)
    mesh: Any = None

    @property
    def world_size(self) -> int:
        return self.num_sample_groups * self.grid.size


def create_hybrid_layout(parts: tuple[int, ...], timeout: datetime.timedelta | None = None,
                         device_type: str = "cpu") -> HybridLayout:
    """Split the world into sample groups of ``prod(parts)`` contiguous ranks (contiguous ranks share a node, so
    halo exchanges stay on-node where possible): a ``("sample", "tile")`` DeviceMesh whose groups inherit
    ``timeout`` (by default the world's).  Must be called by every rank."""
    parts = tuple(int(p) for p in parts)
    size = math.prod(parts)
    if not dist.is_initialized():
        if size != 1:
            raise RuntimeError(
                f"spatial_parts={parts} needs torch.distributed to be initialised with {size} ranks per sample"
            )
        return HybridLayout(SpatialGrid.single(len(parts)), 1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    tile = MeshDim("tile", size, setting=f"spatial_parts={parts_text(parts)}={size}", what="ranks per sample")
    dims = [MeshDim("sample"), tile]
    mesh = build_mesh(dims, device_type=device_type, timeout=timeout or default_timeout())
    group = mesh.get_group("tile") if size > 1 else None
    grid = SpatialGrid(parts=parts, ranks=[int(r) for r in mesh["tile"].mesh.tolist()], group=group,
                       local_rank=rank % size)
    return HybridLayout(grid=grid, num_sample_groups=world // size, sample_index=rank // size,
                        replica_group=mesh.get_group("sample"), mesh=mesh)
