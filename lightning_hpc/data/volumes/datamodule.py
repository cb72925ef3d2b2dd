"""``SphereVolumeDataModule``: volumetric binary segmentation (:mod:`.generator`) for the 3-D spatial recipe.

``prepare_data`` writes the samples once under ``data_dir`` (one ``.npy`` per input and label; existing files of
the same size and seed are kept); a spatially parallel strategy calls :meth:`set_spatial_tile` before the
dataloaders exist, and from then on every rank reads only its sub-volume of each sample (:mod:`.dataset`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
from typing_extensions import override

from lightning_hpc.data.common import loader
from lightning_hpc.data.volumes.dataset import SubVolumeDataset, sample_paths
from lightning_hpc.data.volumes.generator import sphere_volume

__all__ = ["SphereVolumeDataModule"]


def _default_root() -> Path:
    return Path(os.environ.get("LIGHTNING_HPC_CACHE", Path.home() / ".cache" / "lightning_hpc")) / "volumes"


class SphereVolumeDataModule(pl.LightningDataModule):
    """``(x (1, D, H, W), y (1, D, H, W))`` per sample: spheres in noise, labelled where the sphere is large.

    Args:
        data_dir: where the samples are written and read (default ``$LIGHTNING_HPC_CACHE/volumes/<D>x<H>x<W>-s<seed>``,
            ``LIGHTNING_HPC_CACHE`` defaulting to ``~/.cache/lightning_hpc``).
        size: ``(D, H, W)`` of a volume.
        train_samples, val_samples: samples per split.
        batch_size: volumes per batch and process.
        seed: generator seed.
        num_workers: dataloader workers.
    """

    #: the batch entries a spatially parallel strategy splits: the volume and its label, both read as sub-volumes
    spatial_tiles = (0, 1)

    def __init__(
        self,
        data_dir: str | None = None,
        size: Sequence[int] = (64, 64, 64),
        train_samples: int = 16,
        val_samples: int = 4,
        batch_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.size = tuple(int(n) for n in size)
        if len(self.size) != 3 or min(self.size) < 4:
            raise ValueError(f"data.size={tuple(size)}: three extents (D, H, W) of at least 4 voxels each")
        if train_samples < 1 or val_samples < 0 or batch_size < 1:
            raise ValueError(
                f"data: train_samples >= 1, val_samples >= 0 and batch_size >= 1 needed, got {train_samples}, "
                f"{val_samples}, {batch_size}"
            )
        tag = "x".join(map(str, self.size)) + f"-s{seed}"
        self.root = Path(data_dir).expanduser() if data_dir else _default_root() / tag
        self.train_samples, self.val_samples = int(train_samples), int(val_samples)
        self.batch_size, self.seed, self.num_workers = int(batch_size), int(seed), int(num_workers)
        self.tile: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.train_set: SubVolumeDataset | None = None
        self.val_set: SubVolumeDataset | None = None

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (1, *self.size)  # type: ignore[return-value]

    def set_spatial_tile(self, tile_index: Sequence[int], parts: Sequence[int]) -> None:
        """Make every sample the sub-volume ``tile_index`` of a ``parts = (pd, ph, pw)`` split of (D, H, W)."""
        index, split = tuple(int(i) for i in tile_index), tuple(int(p) for p in parts)
        if len(split) != 3 or len(index) != 3 or any(not 0 <= i < p for i, p in zip(index, split)):
            raise ValueError(
                f"volumes are split along D, H and W: tile {index} of spatial_parts {split} is not a sub-volume; "
                "use three parts, e.g. spatial_parts=[2,1,1]"
            )
        self.tile = (index, split)
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.set_tile(index, split, self.size)

    def _manifest(self) -> dict:
        return {"size": list(self.size), "seed": self.seed}

    @override
    def prepare_data(self) -> None:
        """Write the samples that are missing (rank 0 of each node, as Lightning calls it)."""
        manifest = self.root / "manifest.json"
        if manifest.exists() and json.loads(manifest.read_text()) != self._manifest():
            raise FileExistsError(
                f"data.data_dir {str(self.root)!r} holds volumes of another size or seed "
                f"({manifest.read_text().strip()}); choose another data_dir"
            )
        counts = {"train": self.train_samples, "val": self.val_samples}
        offset = {"train": 0, "val": 10**6}  # validation volumes are drawn from their own indices
        for split, count in counts.items():
            (self.root / split).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                x_path, y_path = sample_paths(self.root, split, i)
                if x_path.exists() and y_path.exists():
                    continue
                x, y = sphere_volume(self.size, self.seed, offset[split] + i)
                # written under a temporary name first: a reader never sees half a file
                for path, array in ((x_path, x), (y_path, y)):
                    tmp = path.with_suffix(".tmp.npy")
                    np.save(tmp, array)
                    tmp.replace(path)
        manifest.write_text(json.dumps(self._manifest()))

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        for split, count in (("train", self.train_samples), ("val", self.val_samples)):
            for i in range(count):
                for path in sample_paths(self.root, split, i):
                    if not path.exists():
                        raise FileNotFoundError(
                            f"{path} is missing: prepare_data writes the volumes (a launcher that skips it on this "
                            "node needs data.data_dir on a shared file system)"
                        )
        self.train_set = SubVolumeDataset(self.root, "train", self.train_samples)
        self.val_set = SubVolumeDataset(self.root, "val", self.val_samples)
        if self.tile is not None:
            self.set_spatial_tile(*self.tile)

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
