"""Plain-torch networks with the building blocks and the widths and depths of three modern CNN families, to measure
K-FAC (and the other techniques) on what users train today, without a model-zoo dependency:

* :func:`convnext` -- ConvNeXt (Liu et al., 2022): a 4x4 stride-4 patchify stem, stages of blocks ``depthwise 7x7
  conv -> LayerNorm over channels (channels-last) -> Linear 4x -> GELU -> Linear -> layer scale -> residual``,
  LayerNorm + 2x2 stride-2 convolutions between stages; the defaults are ConvNeXt-atto's widths (40, 80, 160, 320)
  and depths (2, 2, 6, 2).
* :func:`efficientnet` -- EfficientNet-B0 (Tan & Le, 2019): MBConv blocks (1x1 expansion, depthwise k x k,
  squeeze-and-excitation, 1x1 projection, BatchNorm, SiLU) in B0's seven stages, a 1x1 head to 1280 channels.
* :func:`mobilenetv3` -- MobileNetV3-Small (Howard et al., 2019): inverted residuals with optional SE
  (hard-sigmoid gate) and ReLU / hard-swish, a 1x1 conv to 576 channels and a 1024-wide hidden Linear head.

``width`` scales every channel count (rounded to a multiple of 8, as the papers' reference code does).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["convnext", "efficientnet", "mobilenetv3", "SqueezeExcite", "ConvNeXtBlock", "LayerNorm2d"]


def _divisible(c: float, by: int = 8) -> int:
    """``c`` rounded to a multiple of ``by``, never below 90 % of ``c`` (the papers' ``make_divisible``)."""
    out = max(by, int(c + by / 2) // by * by)
    return out + by if out < 0.9 * c else out


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an ``N x C x H x W`` tensor (ConvNeXt's "channels_first" LayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: a per-channel gate from the globally pooled input (two 1x1 convolutions)."""

    def __init__(self, channels: int, squeezed: int, gate: type[nn.Module] = nn.Sigmoid,
                 act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.act = act()
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(x.mean((2, 3), keepdim=True)))))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))  # channels-last for the norm and the Linear layers
        h = self.pwconv2(self.act(self.pwconv1(h))) * self.gamma
        return x + h.permute(0, 3, 1, 2)


def convnext(in_channels: int = 3, num_classes: int = 10, dims: tuple[int, ...] = (40, 80, 160, 320),
             depths: tuple[int, ...] = (2, 2, 6, 2), layer_scale: float = 1e-6) -> nn.Sequential:
    """ConvNeXt (defaults: ConvNeXt-atto's widths and depths)."""
    layers: list[nn.Module] = [nn.Conv2d(in_channels, dims[0], 4, stride=4), LayerNorm2d(dims[0])]
    for i, (dim, depth) in enumerate(zip(dims, depths)):
        if i:
            layers += [LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)]
        layers += [ConvNeXtBlock(dim, layer_scale) for _ in range(depth)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], num_classes)]
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MBConv / MobileNetV3 block: 1x1 expansion (skipped at ratio 1), depthwise k x k, optional SE, 1x1
    projection; a residual where the shape allows."""

    def __init__(self, c_in: int, expanded: int, c_out: int, kernel: int, stride: int, act: type[nn.Module],
                 se: SqueezeExcite | None) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != c_in:
            layers += [nn.Conv2d(c_in, expanded, 1, bias=False), nn.BatchNorm2d(expanded), act()]
        layers += [nn.Conv2d(expanded, expanded, kernel, stride, kernel // 2, groups=expanded, bias=False),
                   nn.BatchNorm2d(expanded), act()]
        if se is not None:
            layers.append(se)
        layers += [nn.Conv2d(expanded, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


#: EfficientNet-B0's stages: (expansion, kernel, stride, channels, repeats)
_B0 = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3), (6, 5, 2, 192, 4),
       (6, 3, 1, 320, 1)]


def efficientnet(in_channels: int = 3, num_classes: int = 10, width: float = 1.0,
                 dropout: float = 0.2) -> nn.Sequential:
    """EfficientNet-B0 (``width`` scales the channels)."""
    c = _divisible(32 * width)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.SiLU()]
    for expansion, kernel, stride, channels, repeats in _B0:
        out = _divisible(channels * width)
        for r in range(repeats):
            se = SqueezeExcite(c * expansion, max(1, c // 4), act=nn.SiLU)
            layers.append(InvertedResidual(c, c * expansion, out, kernel, stride if r == 0 else 1, nn.SiLU, se))
            c = out
    head = _divisible(1280 * width)
    layers += [nn.Conv2d(c, head, 1, bias=False), nn.BatchNorm2d(head), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(1), nn.Dropout(dropout), nn.Linear(head, num_classes)]
    return nn.Sequential(*layers)


#: MobileNetV3-Small's blocks: (kernel, expanded, channels, squeeze-excite, hard-swish, stride)
_SMALL = [(3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
          (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 240, 40, True, True, 1),
          (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2),
          (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1)]


def mobilenetv3(in_channels: int = 3, num_classes: int = 10, width: float = 1.0,
                dropout: float = 0.2) -> nn.Sequential:
    """MobileNetV3-Small (``width`` scales the channels, as ``mobilenetv3_small_050`` at 0.5)."""
    c = _divisible(16 * width)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.Hardswish()]
    for kernel, expanded, channels, se, hswish, stride in _SMALL:
        exp, out = _divisible(expanded * width), _divisible(channels * width)
        gate = SqueezeExcite(exp, _divisible(exp / 4), gate=nn.Hardsigmoid) if se else None
        layers.append(InvertedResidual(c, exp, out, kernel, stride, nn.Hardswish if hswish else nn.ReLU, gate))
        c = out
    last = _divisible(576 * width)
    layers += [nn.Conv2d(c, last, 1, bias=False), nn.BatchNorm2d(last), nn.Hardswish(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(1), nn.Linear(last, 1024), nn.Hardswish(), nn.Dropout(dropout), nn.Linear(1024, num_classes)]
    return nn.Sequential(*layers)
