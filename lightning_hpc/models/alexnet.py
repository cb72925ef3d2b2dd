"""The one-tower AlexNet of Krizhevsky, "One weird trick for parallelizing CNNs" (2014), section 5.

Convolutional trunk with 64, 192, 384, 384, 256 filters (11x11/4, 5x5, 3x3, 3x3, 3x3; max-pools after
conv 1, 2 and 5) and a fully-connected head 4096-4096-``num_classes`` with dropout.  ``features`` is the trunk
and ``classifier`` the head, so ``HybridParallelStrategy(head="classifier")`` splits it where the paper does.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AlexNetOneTower", "alexnet_one_tower"]


class AlexNetOneTower(nn.Module):
    def __init__(
        self, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5, fc_width: int = 4096
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(64, 192, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.AdaptiveAvgPool2d((6, 6)),
            nn.Flatten(1),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 6 * 6, fc_width),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def alexnet_one_tower(
    num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5, fc_width: int = 4096
) -> AlexNetOneTower:
    return AlexNetOneTower(num_classes, in_channels, dropout, fc_width)
