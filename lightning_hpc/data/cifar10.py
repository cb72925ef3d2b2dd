"""CIFAR-10 from its python-pickle folder (``data_batch_1..5``, ``test_batch``), synthetic when no folder is given."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_hpc.data.common import loader, require_dir
from lightning_hpc.data.synthetic import SyntheticImages

__all__ = ["Cifar10", "Cifar10DataModule", "CIFAR_MEAN", "CIFAR_STD"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def _read_batches(root: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for name in names:
        path = root / name
        if not path.exists():
            raise FileNotFoundError(
                f"data.root: {str(path)!r} is missing; expected the CIFAR-10 python version (cifar-10-batches-py), "
                "or use data=synthetic"
            )
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


class Cifar10(Dataset):
    """Normalised CIFAR images; training adds the standard 4-pixel-pad random crop and horizontal flip."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, train: bool) -> None:
        mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(3, 1, 1)
        self.images = (images.float() / 255 - mean) / std
        self.labels, self.train = labels, train

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index]
        if self.train:
            x = torch.nn.functional.pad(x, (4, 4, 4, 4))
            i, j = random.randint(0, 8), random.randint(0, 8)
            x = x[:, i : i + 32, j : j + 32]
            if random.random() < 0.5:
                x = x.flip(-1)
        return x, int(self.labels[index])


class Cifar10DataModule(pl.LightningDataModule):
    num_classes = 10
    input_shape = (3, 32, 32)

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 128,
        num_workers: int = 2,
        synthetic_train_size: int = 50000,
        synthetic_val_size: int = 10000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.root, self.batch_size, self.num_workers, self.seed = root, batch_size, num_workers, seed
        self.synthetic_sizes = (synthetic_train_size, synthetic_val_size)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.root is None:
            # Say so: `recipe=resnet_cifar` alone reads like CIFAR-10 training, and its accuracy would mislead.
            rank_zero_warn(
                "data.root is not set: training on synthetic CIFAR-shaped images, not CIFAR-10; "
                "set data.root=/path/to/cifar-10-batches-py (the python version) for the real data set"
            )
            n_train, n_val = self.synthetic_sizes
            self.train_set: SyntheticImages | Cifar10 = SyntheticImages(n_train, (3, 32, 32), 10, self.seed)
            self.val_set: SyntheticImages | Cifar10 = SyntheticImages(n_val, (3, 32, 32), 10, self.seed + 1)
            self.val_set.templates = self.train_set.templates
            return
        root = require_dir(self.root, "data.root")
        self.train_set = Cifar10(*_read_batches(root, [f"data_batch_{i}" for i in range(1, 6)]), train=True)
        self.val_set = Cifar10(*_read_batches(root, ["test_batch"]), train=False)

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
