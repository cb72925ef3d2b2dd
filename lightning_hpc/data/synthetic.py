"""Synthetic image classification of any shape, deterministic from a seed.

Sample ``i`` is generated from ``seed`` and ``i`` alone (no state, nothing materialised), so every rank and
every worker sees the same data and the set is as large as asked for.  Images are a per-class template plus
noise, so a model can actually learn them (useful for smoke-testing convergence, not for accuracy claims).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_hpc.data.common import loader

__all__ = ["SyntheticImages", "SyntheticDataModule"]


class SyntheticImages(Dataset):
    def __init__(
        self, size: int, shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, seed: int = 0, noise: float = 1.0
    ) -> None:
        if size <= 0:
            raise ValueError(f"synthetic data size must be positive, got {size}")
        self.size, self.shape, self.num_classes, self.seed, self.noise = size, tuple(shape), num_classes, seed, noise
        # Low-resolution templates upsampled to the image size keep memory small for 224x224 x 1000 classes.
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(num_classes, self.shape[0], 4, 4, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        template = torch.nn.functional.interpolate(
            self.templates[label : label + 1], size=self.shape[1:], mode="nearest"
        )[0]
        return template + self.noise * torch.randn(self.shape, generator=g), label


class SyntheticDataModule(pl.LightningDataModule):
    def __init__(
        self,
        shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        train_size: int = 1024,
        val_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        noise: float = 1.0,
    ) -> None:
        super().__init__()
        self.shape, self.num_classes = tuple(shape), num_classes
        self.input_shape = self.shape
        self.train_size, self.val_size, self.batch_size = train_size, val_size, batch_size
        self.num_workers, self.seed, self.noise = num_workers, seed, noise

    @override
    def setup(self, stage: str | None = None) -> None:
        self.train_set = SyntheticImages(self.train_size, self.shape, self.num_classes, self.seed, self.noise)
        self.val_set = SyntheticImages(self.val_size, self.shape, self.num_classes, self.seed + 1, self.noise)
        self.val_set.templates = self.train_set.templates  # same classes, fresh noise

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
