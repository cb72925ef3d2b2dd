"""scikit-learn's handwritten digits (1,797 real 8x8 images shipped with scikit-learn, no download)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset
from typing_extensions import override

from lightning_hpc.data.common import loader

__all__ = ["DigitsDataModule", "load_digits_tensors"]


def load_digits_tensors(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Digits as (N, 1, 8, 8) float tensors standardised with the training split's statistics."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data set needs scikit-learn: pip install 'lightning_hpc[digits]'") from e
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(x) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])


class DigitsDataModule(pl.LightningDataModule):
    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.val_fraction, self.num_workers, self.seed = batch_size, val_fraction, num_workers, seed

    @override
    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = load_digits_tensors(self.val_fraction, self.seed)

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
