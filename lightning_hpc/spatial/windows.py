"""The windows of a traced layer along each spatial dimension: which input range an output range reads
(the tile kernels' window functions: :func:`~lightning_hpc.spatial.kernels.convolution_windows`,
:func:`~lightning_hpc.spatial.kernels.pooling_windows`, :func:`~lightning_hpc.spatial.kernels.transposed_windows`,
:func:`~lightning_hpc.spatial.kernels.interpolation_windows`), in 1, 2 or 3 dimensions, and from them the
exact halo a split needs (section III-A: per neighbour, the rows the output tile reads beyond the tile; in 3-D
faces, edges and corners, so halo bytes follow the surface-to-volume ratio).

The acceptance test of a split is the halo plan's own (:func:`~lightning_hpc.spatial.kernels.check_partition`):
a tile thinner than its halo is refused the same way at setup and here.  Plain torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpc.spatial.halo_exchange import PartitionError
from lightning_hpc.spatial.kernels import (
    check_partition,
    convolution_windows,
    interpolation_windows,
    pooling_windows,
    transposed_windows,
)

__all__ = ["layer_windows", "split_works", "halo_elements", "tile_halo_blocks", "CONVOLUTIONS", "TRANSPOSED", "POOLS"]

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def layer_windows(module: nn.Module | None, in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple | None:
    """One window per spatial dimension of ``module`` for an input of ``in_shape`` (N, C, *spatial), or None for
    a layer that reads no neighbouring rows (element-wise layers, 1 x 1 stride-1 convolutions excepted: they get
    windows too, whose halo is empty) or has no tiled kernel (gathered by the op dispatch).  The windows are the
    tile kernels' own (:mod:`lightning_hpc.spatial.kernels`), so the setup check, the planner and the kernels
    accept the same splits."""
    k = len(in_shape) - 2
    if module is None or k < 1:
        return None
    if isinstance(module, TRANSPOSED):
        return transposed_windows(module.weight.shape, module.stride, module.padding, module.output_padding,
                                  module.dilation)
    if isinstance(module, CONVOLUTIONS):
        return convolution_windows(module.weight.shape, module.stride, module.padding, module.dilation)
    if isinstance(module, POOLS):
        return pooling_windows(k, module.kernel_size, module.stride, module.padding, getattr(module, "dilation", 1),
                               bool(module.ceil_mode))
    if isinstance(module, nn.Upsample) and len(out_shape) == len(in_shape):
        try:
            return interpolation_windows(in_shape[2:], module.size, module.scale_factor, module.mode,
                                         module.align_corners, module.recompute_scale_factor)
        except ValueError:
            return None  # a mode without a tiled kernel (bicubic, area): the op dispatch gathers it
    return None


def split_works(windows: Sequence[Any] | None, extents: Sequence[int], parts: Sequence[int]) -> bool:
    """Whether every tile of ``extents`` split ``parts`` holds at least one row and the halo it needs."""
    if any(n < p for n, p in zip(extents, parts)):
        return False
    if windows is None:
        return True
    try:
        check_partition(extents, parts, windows)
    except PartitionError:
        return False
    return True


def tile_halo_blocks(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]
                     ) -> dict[tuple[int, ...], list[int]]:
    """Per tile, the elements of one sample and channel it receives: one block per neighbour in {-1, 0, 1}^k
    (faces, edges, corners), each the product over dimensions of the received rows (a moved dimension) or the
    tile's own rows its output reads (an unmoved one)."""
    plans = check_partition(extents, parts, windows)
    out: dict[tuple[int, ...], list[int]] = {}
    for index in itertools.product(*(range(p) for p in parts)):
        blocks = out[index] = []
        for delta in itertools.product((-1, 0, 1), repeat=len(parts)):
            if not any(delta) or not all(0 <= i + d < p for i, d, p in zip(index, delta, parts)):
                continue
            sizes = [plan.recv_range(i, d) for plan, i, d in zip(plans, index, delta)]
            count = math.prod(max(hi - lo, 0) for lo, hi in sizes)
            if count:
                blocks.append(count)
    return out


def halo_elements(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]) -> list[int]:
    """Per message of the busiest tile (the one receiving the most), the elements of one sample and channel it
    receives (:func:`tile_halo_blocks`)."""
    if all(p == 1 for p in parts):
        return []
    return max(tile_halo_blocks(windows, extents, parts).values(), key=sum)
