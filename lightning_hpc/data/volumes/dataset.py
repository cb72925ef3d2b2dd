"""A map-style dataset over volumes stored as ``.npy`` files that reads one sub-volume of each sample.

``numpy.load(mmap_mode="r")`` maps the file; slicing the map reads only the pages of the sub-volume (whole rows
of W are contiguous), so a rank holding ``1 / prod(parts)`` of a volume reads about that fraction of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_hpc.distributed.partition import block_bounds

__all__ = ["SubVolumeDataset", "sample_paths"]


def sample_paths(root: Path, split: str, index: int) -> tuple[Path, Path]:
    """The input and label files of sample ``index`` of ``split`` (``train`` / ``val``) under ``root``."""
    return root / split / f"{index:05d}_x.npy", root / split / f"{index:05d}_y.npy"


class SubVolumeDataset(Dataset):
    """Samples ``0..count-1`` of ``root/split``; after :meth:`set_tile`, each item is that sub-volume of the input
    and of the label (tiles of D, H, W blocked as :func:`~lightning_hpc.distributed.partition.block_bounds`)."""

    def __init__(self, root: Path, split: str, count: int) -> None:
        self.root, self.split, self.count = Path(root), split, int(count)
        self.cut: tuple[slice, ...] = (slice(None),) * 3

    def set_tile(self, index: Sequence[int], parts: Sequence[int], extent: Sequence[int]) -> None:
        if len(parts) != 3 or len(index) != 3:
            raise ValueError(
                f"volumes are split along D, H and W: spatial_parts needs 3 entries, e.g. (2, 1, 1), got {tuple(parts)}"
            )
        self.cut = tuple(slice(*block_bounds(int(n), int(p))[int(i)]) for n, p, i in zip(extent, parts, index))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x_path, y_path = sample_paths(self.root, self.split, i)
        cut = (slice(None),) + self.cut
        x = np.load(x_path, mmap_mode="r")[cut]
        y = np.load(y_path, mmap_mode="r")[cut]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
