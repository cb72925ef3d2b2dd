"""Pieces shared by the data modules: loader settings and image normalisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "loader", "require_dir"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def loader(
    dataset: Dataset, batch_size: int, num_workers: int, shuffle: bool, drop_last: bool = False, **kwargs: Any
) -> DataLoader:
    """A DataLoader with worker processes and pinned memory where a GPU is present.

    Shuffling is requested here; under a distributed strategy Lightning replaces the sampler with a
    ``DistributedSampler`` so every rank reads its own shard.
    """
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=drop_last,
        **kwargs,
    )


def require_dir(path: str | None, setting: str) -> Path:
    """Fail early, naming the path, when a data directory is missing or empty."""
    if not path:
        raise FileNotFoundError(f"{setting} is not set; point it at your data directory, or use data=synthetic")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"{setting}: data directory {str(p)!r} does not exist; fix the path, or use data=synthetic"
        )
    if not any(p.iterdir()):
        raise FileNotFoundError(f"{setting}: data directory {str(p)!r} is empty; fix the path, or use data=synthetic")
    return p
