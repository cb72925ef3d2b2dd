"""U-Net over 1, 2 or 3 spatial dimensions (Ronneberger et al., 2015; the 3-D form of Çiçek et al., 2016): an
encoder of two convolution-norm-ReLU blocks per level with max-pooling between levels, a decoder of transposed
convolutions whose outputs are cropped to the skip connection's extent and concatenated with it, and a 1 x 1
convolution to the class logits.  Odd extents are allowed (pooling rounds up; the crop takes the decoder back to
the skip's extent), which keeps every layer exact under spatial parallelism on uneven sub-volumes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["UNet", "unet", "activation_bytes"]

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_POOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _block(c_in: int, c_out: int, dims: int, norm: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for c in (c_in, c_out):
        layers.append(_CONV[dims](c, c_out, 3, padding=1, bias=norm == "none"))
        if norm == "batch":
            layers.append(_BATCH_NORM[dims](c_out))
        elif norm == "group":
            layers.append(nn.GroupNorm(min(8, c_out), c_out))
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class UNet(nn.Module):
    """``(N, in_channels, *spatial)`` to ``(N, num_classes, *spatial)``; ``widths`` per level (the first is the
    full-resolution level); ``norm``: ``"batch"``, ``"group"`` or ``"none"``."""

    def __init__(
        self, in_channels: int, num_classes: int, widths: Sequence[int] = (16, 32, 64), spatial_dims: int = 3,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if spatial_dims not in _CONV:
            raise ValueError(f"model.spatial_dims={spatial_dims}: 1, 2 or 3")
        if norm not in ("batch", "group", "none"):
            raise ValueError(f"model.norm={norm!r}: 'batch', 'group' or 'none'")
        if len(widths) < 2 or min(widths) < 1:
            raise ValueError(f"model.widths={list(widths)}: at least two levels of positive widths")
        d = self.spatial_dims = spatial_dims
        self.encoders = nn.ModuleList()
        c = in_channels
        for w in widths:
            self.encoders.append(_block(c, w, d, norm))
            c = w
        self.pool = _POOL[d](2, ceil_mode=True)
        self.ups = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.ups.append(_CONV_T[d](c, w, 2, stride=2))
            self.decoders.append(_block(2 * w, w, d, norm))
            c = w
        self.head = _CONV[d](c, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for k, encoder in enumerate(self.encoders):
            if k:
                x = self.pool(x)
            x = encoder(x)
            skips.append(x)
        skips.pop()
        for up, decoder in zip(self.ups, self.decoders):
            skip = skips.pop()
            x = up(x)
            x = _crop_to(x, skip, self.spatial_dims)
            x = decoder(torch.cat([x, skip], dim=1))
        return self.head(x)


def _crop_to(x: torch.Tensor, skip: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` cropped to the skip's extent (pooling rounded an odd extent up, so the upsampled tensor may be one
    larger); written per dimension count so the model traces with torch.fx (the planner's shape trace)."""
    if dims == 1:
        return x[:, :, : skip.shape[2]]
    if dims == 2:
        return x[:, :, : skip.shape[2], : skip.shape[3]]
    return x[:, :, : skip.shape[2], : skip.shape[3], : skip.shape[4]]


def unet(in_channels: int = 1, num_classes: int = 1, widths: Sequence[int] = (16, 32, 64), spatial_dims: int = 3,
         norm: str = "batch") -> UNet:
    """:class:`UNet` (Hydra target)."""
    return UNet(in_channels, num_classes, widths, spatial_dims, norm)


def activation_bytes(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
    """Bytes autograd keeps for backward over one training forward of one sample of ``input_shape`` (C, *spatial):
    the tensors saved by the graph, each storage counted once (measured with ``saved_tensors_hooks``; parameters
    are not counted).  Activations grow with the voxels, so a run at a small size scales to a large one."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    was = model.training
    model.train()
    x = torch.zeros(1, *input_shape, dtype=dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    model.train(was)
    return sum(seen.values())
