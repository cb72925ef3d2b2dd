"""Image transforms on PIL images, written without torchvision (whose compiled ops may not match torch).

They follow torchvision's definitions: ``RandomResizedCrop`` (scale (0.08, 1), ratio (3/4, 4/3), 10 tries,
then a center crop fallback), ``Resize`` of the shorter side, ``CenterCrop``, horizontal flip, and
``to_tensor`` + normalisation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

__all__ = [
    "random_resized_crop_box",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "ToNormalizedTensor",
    "Compose",
    "imagenet_train_transform",
    "imagenet_val_transform",
]


def random_resized_crop_box(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a crop covering a random area fraction and aspect ratio of the image."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class RandomResizedCrop:
    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        rng: random.Random | None = None,
    ) -> None:
        self.size, self.scale, self.ratio, self.rng = size, scale, ratio, rng or random.Random()

    def __call__(self, img: Image.Image) -> Image.Image:
        left, top, w, h = random_resized_crop_box(img.width, img.height, self.scale, self.ratio, self.rng)
        return img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))


class Resize:
    """Resize so the shorter side equals ``size``, keeping the aspect ratio."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        if w <= h:
            nw, nh = self.size, int(self.size * h / w)
        else:
            nw, nh = int(self.size * w / h), self.size
        return img.resize((nw, nh), Image.Resampling.BILINEAR)


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        left, top = int(round((w - self.size) / 2)), int(round((h - self.size) / 2))
        return img.crop((left, top, left + self.size, top + self.size))


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5, rng: random.Random | None = None) -> None:
        self.p, self.rng = p, rng or random.Random()

    def __call__(self, img: Image.Image) -> Image.Image:
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if self.rng.random() < self.p else img


class ToNormalizedTensor:
    """HWC uint8 PIL image -> CHW float tensor in [0, 1], then (x - mean) / std per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std


class Compose:
    def __init__(self, steps: Sequence[Callable]) -> None:
        self.steps = list(steps)

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


def imagenet_train_transform(
    size: int = 224, mean: Sequence[float] = (0.485, 0.456, 0.406), std: Sequence[float] = (0.229, 0.224, 0.225)
) -> Compose:
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToNormalizedTensor(mean, std)])


def imagenet_val_transform(
    size: int = 224,
    resize: int = 256,
    mean: Sequence[float] = (0.485, 0.456, 0.406),
    std: Sequence[float] = (0.229, 0.224, 0.225),
) -> Compose:
    return Compose([Resize(resize), CenterCrop(size), ToNormalizedTensor(mean, std)])
