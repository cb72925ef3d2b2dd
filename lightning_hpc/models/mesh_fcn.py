"""The mesh-tangling fully convolutional network of Dryden et al. (IPDPS 2019), section VI.

"Six blocks of either three (1K) or five (2K) convolution-batch normalization-ReLU operations, using 3x3
convolutional filters, and a final convolutional layer for prediction.  Downsampling is performed via stride-2
convolution at the first convolutional filter of each block."  The prediction (one logit per pixel for the binary
tangling mask) is upsampled back to the input resolution, as in FCNs (Long et al., CVPR 2015).

The paper does not give filter counts; ``widths`` defaults to a VGG-like doubling capped at 256 (pass the paper
setting you want).  The model is a plain ``nn.Sequential`` of ``Conv2d``, ``BatchNorm2d``, ``ReLU`` and ``Upsample``
only, so the spatial-parallel converter can swap each layer for its distributed version.  Inputs need H and W
divisible by ``2 ** len(widths)`` (64 for six blocks) so the upsampled prediction matches the input size.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["MeshFCN", "mesh_fcn", "DEFAULT_WIDTHS"]

DEFAULT_WIDTHS = (16, 32, 64, 128, 256, 256)


def _block(in_channels: int, out_channels: int, convs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(convs):
        stride = 2 if k == 0 else 1  # downsample at the first conv of each block (section VI)
        layers += [
            nn.Conv2d(in_channels if k == 0 else out_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        ]
    return nn.Sequential(*layers)


class MeshFCN(nn.Sequential):
    """``block1..blockB`` (conv-BN-ReLU x ``convs_per_block``), ``predict`` (1x1 conv), ``upsample``."""

    def __init__(
        self,
        in_channels: int = 18,
        convs_per_block: int = 3,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        num_classes: int = 1,
        upsample_mode: str = "nearest",
    ) -> None:
        if convs_per_block < 1 or not widths or any(w < 1 for w in widths):
            raise ValueError(
                f"mesh_fcn needs convs_per_block >= 1 and positive widths, got {convs_per_block}, {list(widths)}"
            )
        if upsample_mode not in ("nearest", "bilinear"):
            raise ValueError(f"mesh_fcn upsample_mode must be 'nearest' or 'bilinear', got {upsample_mode!r}")
        layers: dict[str, nn.Module] = {}
        prev = in_channels
        for b, width in enumerate(widths, start=1):
            layers[f"block{b}"] = _block(prev, width, convs_per_block)
            prev = width
        layers["predict"] = nn.Conv2d(prev, num_classes, kernel_size=1)
        factor = 2 ** len(widths)
        layers["upsample"] = nn.Upsample(
            scale_factor=factor, mode=upsample_mode, **({"align_corners": False} if upsample_mode == "bilinear" else {})
        )
        super().__init__()
        for name, module in layers.items():
            self.add_module(name, module)
        self.downsampling = factor


def mesh_fcn(
    in_channels: int = 18,
    convs_per_block: int = 3,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    num_classes: int = 1,
    upsample_mode: str = "nearest",
) -> MeshFCN:
    """``convs_per_block=3`` is the paper's 1K (1024^2) model, ``5`` its 2K (2048^2) model."""
    return MeshFCN(in_channels, convs_per_block, tuple(widths), num_classes, upsample_mode)
