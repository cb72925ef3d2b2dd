"""The windows of a traced layer along each spatial dimension: which input range an output range reads
(:class:`~lightning_hpc.spatial.halo_exchange.Window1d` for convolutions and pools,
:class:`~lightning_hpc.spatial.convtranspose.TransposedWindow1d` for transposed convolutions,
:class:`~lightning_hpc.spatial.upsample.Interp1d` for interpolation), in 1, 2 or 3 dimensions, and from them the
exact halo a split needs (section III-A: per neighbour, the rows the output tile reads beyond the tile; in 3-D
faces, edges and corners, so halo bytes follow the surface-to-volume ratio).

The acceptance test of a split is the halo plan's own (:class:`~lightning_hpc.spatial.halo_exchange.DimPlan`):
a tile thinner than its halo is refused the same way at setup and here.  Plain torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_hpc.spatial.convtranspose import TransposedWindow1d
from lightning_hpc.spatial.halo_exchange import DimPlan, PartitionError, Window1d
from lightning_hpc.spatial.upsample import Interp1d

__all__ = ["layer_windows", "split_works", "halo_elements", "CONVOLUTIONS", "TRANSPOSED", "POOLS"]

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def _ntuple(v: Any, k: int) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * k


def layer_windows(module: nn.Module | None, in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple | None:
    """One window per spatial dimension of ``module`` for an input of ``in_shape`` (N, C, *spatial), or None for
    a layer that reads no neighbouring rows (element-wise layers, 1 x 1 stride-1 convolutions excepted: they get
    windows too, whose halo is empty)."""
    k = len(in_shape) - 2
    if module is None or k < 1:
        return None
    if isinstance(module, TRANSPOSED):
        ks, s, p, d, op = (_ntuple(v, k) for v in (module.kernel_size, module.stride, module.padding,
                                                    module.dilation, module.output_padding))
        return tuple(TransposedWindow1d(*args) for args in zip(ks, s, p, d, op))
    if isinstance(module, CONVOLUTIONS):
        ks, s, d = (_ntuple(v, k) for v in (module.kernel_size, module.stride, module.dilation))
        if module.padding == "same":
            # d(k-1) padding in all, the odd one at the end (torch's rule): the output keeps the input's extent
            return tuple(_SameWindow(ki, 1, di * (ki - 1) // 2, di) for ki, di in zip(ks, d))
        p = (0,) * k if module.padding == "valid" else _ntuple(module.padding, k)
        return tuple(Window1d(*args) for args in zip(ks, s, p, d))
    if isinstance(module, POOLS):
        ks = _ntuple(module.kernel_size, k)
        s = _ntuple(module.stride if module.stride is not None else module.kernel_size, k)
        p = _ntuple(module.padding, k)
        d = _ntuple(getattr(module, "dilation", 1), k)
        return tuple(Window1d(*args, ceil_mode=bool(module.ceil_mode)) for args in zip(ks, s, p, d))
    if isinstance(module, nn.Upsample) and len(out_shape) == len(in_shape):
        wins = []
        for n_in, n_out in zip(in_shape[2:], out_shape[2:]):
            ac = bool(module.align_corners) and module.mode != "nearest"
            scale = (n_in - 1) / (n_out - 1) if ac and n_out > 1 else n_in / n_out
            wins.append(Interp1d("nearest" if module.mode == "nearest" else "linear", int(n_in), int(n_out), scale, ac))
        return tuple(wins)
    return None


class _SameWindow(Window1d):
    """A stride-1 window padded ``span - 1`` in all, ``padding`` of it before: the output has the input's extent."""

    def out_size(self, n: int) -> int:
        return n


def _plans(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]) -> list[DimPlan]:
    return [DimPlan(n, w.out_size(n), p, w) for w, n, p in zip(windows, extents, parts)]


def split_works(windows: Sequence[Any] | None, extents: Sequence[int], parts: Sequence[int]) -> bool:
    """Whether every tile of ``extents`` split ``parts`` holds at least one row and the halo it needs."""
    if any(n < p for n, p in zip(extents, parts)):
        return False
    if windows is None:
        return True
    try:
        _plans(windows, extents, parts)
    except PartitionError:
        return False
    return True


def halo_elements(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]) -> list[int]:
    """Per message of the busiest tile (the one receiving the most), the elements of one sample and channel it
    receives: one block per neighbour in {-1, 0, 1}^k (faces, edges, corners), each the product over dimensions
    of the received rows (a moved dimension) or the tile's own rows its output reads (an unmoved one)."""
    if all(p == 1 for p in parts):
        return []
    plans = _plans(windows, extents, parts)
    busiest: list[int] = []
    for index in itertools.product(*(range(p) for p in parts)):
        blocks = []
        for delta in itertools.product((-1, 0, 1), repeat=len(parts)):
            if not any(delta) or not all(0 <= i + d < p for i, d, p in zip(index, delta, parts)):
                continue
            sizes = [plan.recv_range(i, d) for plan, i, d in zip(plans, index, delta)]
            count = math.prod(max(hi - lo, 0) for lo, hi in sizes)
            if count:
                blocks.append(count)
        if sum(blocks) > sum(busiest):
            busiest = blocks
    return busiest
