"""ImageNet-layout image folders (``root/train/<class>/*.JPEG``, ``root/val/<class>/*.JPEG``), decoded with Pillow."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from PIL import Image
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_hpc.data.common import IMAGENET_MEAN, IMAGENET_STD, loader, require_dir
from lightning_hpc.data.transforms import (
    imagenet_train_transform,
    imagenet_val_transform,
)

__all__ = ["ImageFolder", "ImageFolderDataModule", "IMG_EXTENSIONS"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp", ".tif", ".tiff")


class ImageFolder(Dataset):
    """Samples ``(transform(image), class_index)``; classes are the sorted sub-directory names."""

    def __init__(
        self, root: str | Path, transform: Callable[[Image.Image], torch.Tensor], classes: list[str] | None = None
    ) -> None:
        self.root = Path(root)
        self.classes = classes or sorted(d.name for d in self.root.iterdir() if d.is_dir())
        if not self.classes:
            raise FileNotFoundError(
                f"no class sub-directories in {str(self.root)!r}; expected root/<class>/<image> (ImageNet layout), "
                "or use data=synthetic"
            )
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [
            (str(f), self.class_to_idx[c])
            for c in self.classes
            if (self.root / c).is_dir()
            for f in sorted((self.root / c).iterdir())
            if f.suffix.lower() in IMG_EXTENSIONS
        ]
        if not self.samples:
            raise FileNotFoundError(
                f"no images ({', '.join(IMG_EXTENSIONS)}) under {str(self.root)!r}; fix the path, or use data=synthetic"
            )
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label


class ImageFolderDataModule(pl.LightningDataModule):
    """ImageNet-style training data: random-resized-crop + flip for training, resize 256 + center crop 224 for
    validation, ImageNet mean/std normalisation (the preprocessing of the K-FAC and hybrid papers' runs)."""

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 32,
        num_workers: int = 4,
        image_size: int = 224,
        resize_size: int = 256,
        train_dir: str = "train",
        val_dir: str = "val",
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        self.root, self.batch_size, self.num_workers = root, batch_size, num_workers
        self.image_size, self.resize_size, self.train_dir, self.val_dir = image_size, resize_size, train_dir, val_dir
        self.num_classes = num_classes
        self.input_shape = (3, image_size, image_size)

    @override
    def setup(self, stage: str | None = None) -> None:
        root = require_dir(self.root, "data.root")
        for split in (self.train_dir, self.val_dir):
            require_dir(str(root / split), f"data.root ({split} split)")
        self.train_set = ImageFolder(
            root / self.train_dir, imagenet_train_transform(self.image_size, IMAGENET_MEAN, IMAGENET_STD)
        )
        self.val_set = ImageFolder(
            root / self.val_dir,
            imagenet_val_transform(self.image_size, self.resize_size, IMAGENET_MEAN, IMAGENET_STD),
            classes=self.train_set.classes,
        )
        if self.num_classes is not None and self.num_classes != len(self.train_set.classes):
            raise ValueError(
                f"data.num_classes={self.num_classes} but {str(root / self.train_dir)!r} has "
                f"{len(self.train_set.classes)} class folders"
            )

    @override
    def train_dataloader(self):
        return loader(self.train_set, self.batch_size, self.num_workers, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self):
        return loader(self.val_set, self.batch_size, self.num_workers, shuffle=False)
