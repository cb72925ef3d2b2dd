"""A small CNN for 8x8 digits and other tiny images (the default recipe's model)."""

from __future__ import annotations

from torch import nn

__all__ = ["small_cnn"]


def small_cnn(in_channels: int = 1, num_classes: int = 10, width: int = 32, dropout: float = 0.1) -> nn.Sequential:
    """conv-BN-ReLU x2, 2x2 max-pool, conv-BN-ReLU, global average pool, linear.

    Kept as a plain ``nn.Sequential`` so every strategy can adapt it.
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(1),
        nn.Dropout(dropout),
        nn.Linear(2 * width, num_classes),
    )
