"""ResNets without torchvision.

* ImageNet ResNet-18/34/50/101/152 (He et al. 2016) with the layout of the reference implementations
  (stride on the 3x3 conv of the bottleneck, "ResNet v1.5"; projection shortcuts when the shape changes), so
  parameter counts match exactly: 11,689,512 / 21,797,672 / 25,557,032 / 44,549,160 / 60,192,808 (1000 classes).
* CIFAR ResNet-20/32/44/56/110 (He et al. 2016, section 4.2): three stages of 16/32/64 channels, 6n+2 layers,
  parameter-free identity shortcuts (option A: stride-2 subsampling and zero-padded channels), as used by the
  K-FAC paper's CIFAR-10 experiments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "CifarResNet",
    "cifar_resnet",
    "IMAGENET_DEPTHS",
    "CIFAR_DEPTHS",
]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ImageNet ResNet: 7x7/2 stem, 3x3/2 max-pool, four stages, global average pool, FC."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        in_channels: int = 3,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:  # Goyal et al.: each block starts as the identity
            for m in self.modules():
                last = m.bn3 if isinstance(m, Bottleneck) else m.bn2 if isinstance(m, BasicBlock) else None
                if last is not None:
                    nn.init.zeros_(last.weight)

    def _make_layer(
        self, block: type[BasicBlock] | type[Bottleneck], width: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, width * block.expansion, stride), nn.BatchNorm2d(width * block.expansion)
            )
        layers = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = width * block.expansion
        layers += [block(self.inplanes, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


IMAGENET_DEPTHS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
    152: (Bottleneck, [3, 8, 36, 3]),
}


def resnet(depth: int = 50, num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = False) -> ResNet:
    """ImageNet ResNet of the given depth (18, 34, 50, 101 or 152)."""
    if depth not in IMAGENET_DEPTHS:
        raise ValueError(f"ImageNet ResNet depth must be one of {sorted(IMAGENET_DEPTHS)}, got {depth}")
    block, layers = IMAGENET_DEPTHS[depth]
    return ResNet(
        block, layers, num_classes=num_classes, in_channels=in_channels, zero_init_residual=zero_init_residual
    )


def _named(depth: int) -> Callable[..., ResNet]:
    def build(num_classes: int = 1000, **kwargs: object) -> ResNet:
        return resnet(depth, num_classes, **kwargs)  # type: ignore[arg-type]

    build.__name__ = f"resnet{depth}"
    build.__doc__ = f"ImageNet ResNet-{depth}."
    return build


resnet18, resnet34, resnet50, resnet101, resnet152 = (_named(d) for d in (18, 34, 50, 101, 152))


class _PadShortcut(nn.Module):
    """Option-A shortcut: subsample by ``stride`` and zero-pad the new channels (no parameters)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride, self.pad = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))


class _CifarBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _PadShortcut(cin, cout, stride) if (stride != 1 or cin != cout) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth: int = 32, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, 56, 110, ...), got {depth}")
        n = (depth - 2) // 6
        self.conv1 = conv3x3(in_channels, 16)
        self.bn1 = nn.BatchNorm2d(16)
        stages, cin = [], 16
        for i, width in enumerate((16, 32, 64)):
            blocks = []
            for j in range(n):
                blocks.append(_CifarBlock(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


CIFAR_DEPTHS = (20, 32, 44, 56, 110)


def cifar_resnet(depth: int = 32, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """CIFAR ResNet-(6n+2)."""
    return CifarResNet(depth, num_classes, in_channels)
