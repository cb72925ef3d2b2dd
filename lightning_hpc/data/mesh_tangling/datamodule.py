"""``MeshTanglingDataModule``: the mesh-tangling segmentation data (Dryden et al., section VI) for Lightning.

Reads LBANN-layout files (``data_dir``) or generates samples on the fly (``on_the_fly=True``).  A spatially
parallel strategy calls :meth:`MeshTanglingDataModule.set_spatial_tile` before the dataloaders are built; from
then on every sample is only that tile of the inputs and of the mask, read from disk without loading the rest.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from lightning_hpc.data.common import loader
from lightning_hpc.data.mesh_tangling.dataset import (
    DiskSource,
    MeshSource,
    MeshTanglingDataset,
    OnTheFlySource,
)
from lightning_hpc.data.mesh_tangling.generator import (
    CHANNELS,
    DEFAULT_LOOKAHEAD,
    DEFAULT_STEPS,
)
from lightning_hpc.data.mesh_tangling.layout import count_samples

__all__ = ["MeshTanglingDataModule"]


class MeshTanglingDataModule(pl.LightningDataModule):
    """Mesh-tangling data: ``(x (18, h, w), mask (1, h, w))`` per sample.

    ``data_dir``: a directory in LBANN's layout (``lightning-hpc mesh-data --out DIR`` writes one); the first
    ``train_samples`` samples train (default: all but the validation ones), the next ``val_samples`` validate.
    ``on_the_fly=True``: samples ``0..train_samples-1`` (train) and the following ``val_samples`` (validation)
    are generated from ``seed`` at ``size x size`` when read.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        on_the_fly: bool = False,
        size: int = 1024,
        train_samples: int | None = None,
        val_samples: int = 2,
        batch_size: int = 1,
        seed: int = 0,
        suffix: str = "",
        normalize: bool = True,
        steps: int = DEFAULT_STEPS,
        lookahead: int = DEFAULT_LOOKAHEAD,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if val_samples < 0 or (train_samples is not None and train_samples < 1):
            raise ValueError(
                f"data.train_samples must be >= 1 and data.val_samples >= 0, got {train_samples}, {val_samples}"
            )
        self.data_dir, self.on_the_fly, self.size = data_dir, on_the_fly, size
        self.train_samples, self.val_samples, self.batch_size = train_samples, val_samples, batch_size
        self.seed, self.suffix, self.normalize = seed, suffix, normalize
        self.steps, self.lookahead, self.num_workers = steps, lookahead, num_workers
        self.tile: tuple[tuple[int, int], tuple[int, int]] | None = None
        self.source: MeshSource | None = None
        self.train_set: MeshTanglingDataset | None = None
        self.val_set: MeshTanglingDataset | None = None

    #: the batch entries :meth:`set_spatial_tile` makes tiles: the input channels and the mask (a spatially parallel
    #: strategy splits exactly these)
    spatial_tiles = (0, 1)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        height, width = self.source.shape if self.source else (self.size, self.size)
        return (len(CHANNELS), height, width)

    def set_spatial_tile(self, tile_index: tuple[int, int], parts: tuple[int, int]) -> None:
        """Make every sample the tile ``tile_index = (i, j)`` of a ``parts = (ph, pw)`` partition of (H, W).

        Tiles follow :func:`lightning_hpc.distributed.partition.block_bounds` on H, then on W.  Call before the
        dataloaders are built (a spatially parallel strategy does so in its setup).
        """
        (i, j), (ph, pw) = tuple(tile_index), tuple(parts)
        if ph < 1 or pw < 1:
            raise ValueError(f"spatial parts must be positive, got {parts}")
        if not (0 <= i < ph and 0 <= j < pw):
            raise ValueError(f"tile index {tile_index} out of range for a {ph} x {pw} partition")
        self.tile = ((int(i), int(j)), (int(ph), int(pw)))
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.set_tile(*self.tile)

    def _make_source(self) -> tuple[MeshSource, int]:
        if self.on_the_fly:
            total = (self.train_samples or 16) + self.val_samples
            return OnTheFlySource(self.size, self.seed, self.steps, self.lookahead), total
        hint = (
            f"generate it with `lightning-hpc mesh-data --size {self.size} --samples 16 --out DIR`, or set "
            "data.on_the_fly=true to generate samples on the fly"
        )
        if not self.data_dir:
            raise FileNotFoundError(f"data.data_dir is not set; {hint}")
        root = Path(self.data_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"data.data_dir: mesh data directory {str(root)!r} does not exist; {hint}")
        available = count_samples(root, self.suffix)
        if available == 0:
            raise FileNotFoundError(
                f"data.data_dir: no complete mesh sample (18 channels + mask, index 0000) in {str(root)!r}; {hint}"
            )
        return DiskSource(root, self.suffix), available

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.source is not None:
            return
        source, available = self._make_source()
        n_train = self.train_samples if self.train_samples is not None else available - self.val_samples
        if n_train < 1 or n_train + self.val_samples > available:
            raise ValueError(
                f"data: {available} samples available, cannot take train_samples={self.train_samples} and "
                f"val_samples={self.val_samples}; lower them or generate more samples"
            )
        self.source = source
        self.train_set = MeshTanglingDataset(source, range(n_train), self.normalize)
        self.val_set = MeshTanglingDataset(source, range(n_train, n_train + self.val_samples), self.normalize)
        if self.tile is not None:
            self.set_spatial_tile(*self.tile)

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
