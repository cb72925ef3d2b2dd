"""Mesh-tangling samples as a torch ``Dataset``, whole or one spatial tile of each, from disk or on the fly.

A sample is ``(x, mask)``: ``x`` float32 ``(18, h, w)`` (the channels of :data:`CHANNELS`, optionally normalised
by :func:`normalize_channels`) and ``mask`` float32 ``(1, h, w)`` in {0, 1}, where ``h x w`` is the tile (the whole
sample unless a tile is set).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_hpc.data.mesh_tangling.generator import (
    CHANNELS,
    DEFAULT_LOOKAHEAD,
    DEFAULT_STEPS,
    TARGET,
    generate_sample,
)
from lightning_hpc.data.mesh_tangling.layout import read_tile, sample_shape
from lightning_hpc.distributed.partition import block_range

__all__ = ["MeshSource", "DiskSource", "OnTheFlySource", "MeshTanglingDataset", "normalize_channels", "tile_bounds"]

Bounds = tuple[tuple[int, int], tuple[int, int]]


def tile_bounds(shape: tuple[int, int], tile_index: tuple[int, int], parts: tuple[int, int]) -> Bounds:
    """Rows and columns of tile ``(i, j)`` of a ``parts = (ph, pw)`` blocked partition (``block_bounds`` on H
    then W: the first ``H % ph`` row blocks are one row larger)."""
    (height, width), (i, j), (ph, pw) = shape, tile_index, parts
    return block_range(height, ph, i), block_range(width, pw, j)


def _symlog(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log1p(x.abs())


def normalize_channels(x: torch.Tensor, cell_area: float) -> torch.Tensor:
    """Fixed, per-pixel transforms that put every channel near unit scale (so any tile is normalised the same
    way without global statistics): heavy-tailed metrics on a log scale, areas in units of the initial cell
    area, angles in right angles."""
    out = x.clone()
    idx = {name: k for k, name in enumerate(CHANNELS)}
    for name in ("Density", "Pressure", "aspectRatio", "conditionNumber", "oddy", "taper"):
        out[idx[name]] = _symlog(x[idx[name]])
    out[idx["VectorComp_AvgVelocity_R"]] = 10 * x[idx["VectorComp_AvgVelocity_R"]]
    for name in ("jacobian", "volume"):
        out[idx[name]] = _symlog(x[idx[name]] / cell_area)
    out[idx["distortion"]] = _symlog(x[idx["distortion"]])
    for name in ("largestAngle", "smallestAngle"):
        out[idx[name]] = x[idx[name]] / 90.0
    return out


class MeshSource:
    """Where samples come from: ``shape`` (H, W) and ``read(index, rows, cols) -> {channel: array}``."""

    shape: tuple[int, int]

    def read(self, index: int, rows: tuple[int, int], cols: tuple[int, int]) -> dict[str, np.ndarray]:
        raise NotImplementedError


class DiskSource(MeshSource):
    """LBANN-layout files; reads only the requested rows and columns of each channel."""

    def __init__(self, root: str | os.PathLike, suffix: str = "") -> None:
        self.root, self.suffix = root, suffix
        self.shape = sample_shape(root, suffix)

    def read(self, index: int, rows: tuple[int, int], cols: tuple[int, int]) -> dict[str, np.ndarray]:
        return {c: read_tile(self.root, c, index, self.shape, rows, cols, self.suffix) for c in (*CHANNELS, TARGET)}


class OnTheFlySource(MeshSource):
    """Generates samples when asked (tests, benchmarks).  The generator computes the whole sample, then the tile
    is cut out of it: unlike :class:`DiskSource`, this mode does hold a full sample per process; the last
    ``cache`` samples are kept so that the tiles of one sample are not regenerated."""

    def __init__(
        self,
        size: int | Sequence[int],
        seed: int = 0,
        steps: int = DEFAULT_STEPS,
        lookahead: int = DEFAULT_LOOKAHEAD,
        cache: int = 1,
    ) -> None:
        self.shape = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
        self.seed, self.steps, self.lookahead, self.cache = seed, steps, lookahead, cache
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    def full(self, index: int) -> dict[str, np.ndarray]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        sample = generate_sample(self.seed, index, self.shape, self.steps, self.lookahead)
        if self.cache > 0:
            self._cache[index] = sample
            while len(self._cache) > self.cache:
                self._cache.popitem(last=False)
        return sample

    def read(self, index: int, rows: tuple[int, int], cols: tuple[int, int]) -> dict[str, np.ndarray]:
        sample = self.full(index)
        return {c: sample[c][rows[0] : rows[1], cols[0] : cols[1]] for c in (*CHANNELS, TARGET)}


class MeshTanglingDataset(Dataset):
    """Samples ``indices`` of ``source``; :meth:`set_tile` restricts every sample to one tile."""

    def __init__(self, source: MeshSource, indices: Sequence[int], normalize: bool = True) -> None:
        self.source, self.indices, self.normalize = source, list(indices), normalize
        height, width = source.shape
        self.rows, self.cols = (0, height), (0, width)

    def set_tile(self, tile_index: tuple[int, int], parts: tuple[int, int]) -> None:
        self.rows, self.cols = tile_bounds(self.source.shape, tile_index, parts)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.source.read(self.indices[k], self.rows, self.cols)
        x = torch.from_numpy(np.stack([data[c] for c in CHANNELS]))
        if self.normalize:
            height, width = self.source.shape
            x = normalize_channels(x, cell_area=1.0 / (height * width))
        mask = torch.from_numpy(np.ascontiguousarray(data[TARGET], dtype=np.float32)).unsqueeze(0)
        return x, mask
