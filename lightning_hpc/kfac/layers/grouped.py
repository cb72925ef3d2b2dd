"""K-FAC for grouped (and depthwise) convolutions and grouped transposed convolutions (``groups > 1``): each group
is a convolution of its own with its own Kronecker block (the KFC factors of :mod:`.conv` and :mod:`.transposed`,
Grosse & Martens 2016), one handler per group named ``<layer>#g<i>``, so the layer's curvature is block-diagonal over
its groups as K-FAC's is over layers (Martens & Grosse 2015, section 3).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.conv import ConvHandler
from lightning_hpc.kfac.layers.transposed import ConvTransposeHandler

__all__ = ["GroupConvHandler", "GroupConvTransposeHandler"]


class _OneGroup(LayerHandler):
    """The channel slicing of one group of a grouped (transposed) convolution: the group's input channels form its
    statistics' input, its output channels their output gradient (put before the layer's handler in the bases)."""

    group: int
    in_per_group: int
    out_per_group: int

    def _set_group(self, module: nn.Module, group: int) -> None:
        m = cast(Any, module)
        self.group = group
        self.in_per_group = m.in_channels // m.groups
        self.out_per_group = m.out_channels // m.groups

    def _channels(self, t: torch.Tensor, per_group: int) -> torch.Tensor:
        dim = t.dim() - len(cast(Any, self.module).kernel_size) - 1  # 0 for an unbatched input, else 1
        return t.narrow(dim, self.group * per_group, per_group)

    def capture_input(self, x: torch.Tensor) -> int:
        return super().capture_input(self._channels(x, self.in_per_group))

    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        return super().capture_output_grad(self._channels(g, self.out_per_group), token)


class GroupConvHandler(_OneGroup, ConvHandler):
    """One group of a grouped convolution (``groups > 1``; depthwise when each group has one input channel).

    Group ``i``'s weights ``W[i Co/g : (i+1) Co/g]`` see only input channels ``[i Ci/g, (i+1) Ci/g)`` and produce
    only output channels ``[i Co/g, (i+1) Co/g)``: each group is a convolution of its own, and K-FAC gives it its
    own Kronecker block (KFC's factors of that sub-convolution), so the layer's curvature is block-diagonal over
    its groups, as K-FAC's is over layers (Martens & Grosse 2015, section 3). The handler is named
    ``<layer>#g<i>``; its gradient matrix is the group's rows of ``[dW | db]``.
    """

    refuses_split_input = True  # type: ignore[assignment]

    def __init__(self, name: str, module: nn.Conv1d | nn.Conv2d | nn.Conv3d, group: int) -> None:
        self._set_group(module, group)
        super().__init__(f"{name}#g{group}", module)
        self.rows = slice(group * self.out_per_group, (group + 1) * self.out_per_group)

    @property
    def a_dim(self) -> int:
        return self.in_per_group * math.prod(self.module.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.out_per_group


class GroupConvTransposeHandler(_OneGroup, ConvTransposeHandler):
    """One group of a grouped transposed convolution (``groups > 1``).

    The weight is ``(C_in, C_out / groups, *kernel)``: group ``i``'s input channels ``[i C_in/g, (i+1) C_in/g)``
    scatter only into its output channels ``[i C_out/g, (i+1) C_out/g)``, so each group is a transposed
    convolution of its own and gets its own block of :class:`ConvTransposeHandler`'s swapped KFC form, as a grouped
    convolution's groups do (:class:`GroupConvHandler`). Named ``<layer>#g<i>``; its gradient matrix is its input
    channels' rows of ``dW``, viewed as ``(C_out/g * prod(kernel), C_in/g)``.
    """

    def __init__(self, name: str, module: nn.Module, group: int) -> None:
        self._set_group(module, group)
        super().__init__(f"{name}#g{group}", module)
        self.rows = slice(group * self.in_per_group, (group + 1) * self.in_per_group)

    @property
    def a_dim(self) -> int:
        return self.in_per_group

    @property
    def g_dim(self) -> int:
        return self.out_per_group * math.prod(self.module.kernel_size)
