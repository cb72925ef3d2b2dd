"""Transposed convolution (``F.conv_transpose1d/2d/3d``) of a tile split over 1, 2 or 3 spatial dimensions, exact
for any stride, padding, output padding, dilation and groups (the halo exchange of Dryden et al., section III-A,
applied to the transposed op's input windows).

Output ``o`` of a transposed convolution along one dimension sums inputs ``i`` with ``i*s + d*t - p = o`` for
``t = 0..k-1``, i.e. ``i`` in ``[ceil((o + p - d(k-1)) / s), floor((o + p) / s)]``.  :class:`TransposedWindow1d`
(:func:`transposed_windows`) gives that input range for an output tile, so the halo exchange brings exactly the
neighbouring entries this tile's (blocked) output needs.  On the extended input box starting at input ``lo`` the
local transposed convolution without padding yields global outputs ``lo*s - p + q``; this output tile is cut
from it (where the stride leaves outputs no input reaches, ``s > d(k-1) + 1``, the cut is completed with zeros
before the bias).  Backward is autograd's through the crop, the local kernel and the exchange's adjoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.kernels.plan import halo_plan, ntuple
from lightning_hpc.spatial.layout.halo_exchange import PartitionError, halo_exchange, trailing
from lightning_hpc.spatial.layout.tiling import SpatialGrid

__all__ = ["TransposedWindow1d", "transposed_windows", "conv_transpose"]

Range = tuple[int, int]
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class TransposedWindow1d:
    """The inputs a transposed convolution's outputs read along one dimension."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    output_padding: int = 0

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        return (n - 1) * self.stride - 2 * self.padding + self.span + self.output_padding

    def needed(self, o0: int, o1: int, n: int) -> Range:
        """Global input range ``[lo, hi)`` read by outputs ``[o0, o1)`` (may reach outside ``[0, n)``: zeros)."""
        lo = math.ceil((o0 + self.padding - self.span + 1) / self.stride)
        hi = (o1 - 1 + self.padding) // self.stride + 1
        return lo, hi


def transposed_windows(weight_shape: Sequence[int], stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                       dilation: Any = 1) -> tuple[TransposedWindow1d, ...]:
    """Per spatial dimension of a transposed convolution with weight ``weight_shape``
    (``C_in x C_out/groups x k_1 ...``), the input window of each output (torch's argument semantics)."""
    k = len(weight_shape) - 2
    if k not in (1, 2, 3):
        raise ValueError(f"conv_transpose: weight of shape {tuple(weight_shape)} has {k} spatial dimensions, not 1-3")
    s, p = ntuple(stride, k, "stride"), ntuple(padding, k, "padding")
    op, d = ntuple(output_padding, k, "output_padding"), ntuple(dilation, k, "dilation")
    return tuple(TransposedWindow1d(int(kk), ss, pp, dd, oo) for kk, ss, pp, dd, oo in
                 zip(weight_shape[2:], s, p, d, op))


def conv_transpose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: SpatialGrid,
                   extents: Sequence[int], stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                   groups: int = 1, dilation: Any = 1) -> torch.Tensor:
    """This rank's output tile of ``F.conv_transpose{k}d(x_global, weight, bias, stride, padding, output_padding,
    groups, dilation)`` (``x``: this rank's tile of a sample whose split dimensions have global ``extents``; the
    output is blocked over the output's global extents)."""
    k = grid.ndim
    op = f"conv_transpose{k}d"
    if weight.dim() != k + 2:
        raise ValueError(f"{op}: weight of shape {tuple(weight.shape)} for a grid of {k} split dimensions")
    windows = transposed_windows(weight.shape, stride, padding, output_padding, dilation)
    plan = halo_plan(grid, extents, windows, op, tile=x)
    box = halo_exchange(x, plan)
    if any(hi <= lo for lo, hi in plan.need):
        raise PartitionError(f"{op}: output tile {plan.out} reads no input (it lies in a stride gap "
                             f"of {[w.stride for w in windows]}); use fewer parts")
    stride, dilation = [w.stride for w in windows], [w.dilation for w in windows]
    shape = [s * (n - 1) + w.span for s, n, w in zip(stride, box.shape[-k:], windows)]  # the local result's extents
    pads: list[int] = []
    cut = []
    for e, (win, (o0, o1), (lo, _)) in enumerate(zip(windows, plan.out, plan.need)):
        q = o0 + win.padding - lo * win.stride  # where output o0 lies in the local result
        before, after = max(0, -q), max(0, q + (o1 - o0) - shape[e])
        pads = [before, after, *pads]  # F.pad order: last dimension first
        cut.append(slice(q + before, q + before + (o1 - o0)))
    if not any(pads):
        return _CONVT[k](box, weight, bias, stride, 0, 0, groups, dilation)[trailing(cut)]
    # outputs in a stride gap past the local result: only the bias reaches them
    y = F.pad(_CONVT[k](box, weight, None, stride, 0, 0, groups, dilation), pads)[trailing(cut)]
    return y if bias is None else y + bias.to(y.dtype).view(-1, *([1] * k))
