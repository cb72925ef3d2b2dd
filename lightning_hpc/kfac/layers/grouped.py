"""K-FAC for grouped (and depthwise) convolutions and grouped transposed convolutions (``groups > 1``): each group
is a convolution of its own with its own Kronecker block (the KFC factors of :mod:`.conv` and :mod:`.transposed`,
Grosse & Martens 2016), so the layer's curvature is block-diagonal over its groups as K-FAC's is over layers
(Martens & Grosse 2015, section 3).

One handler per layer keeps the blocks of all groups stacked: A and G are ``(groups, n, n)``
(:class:`~lightning_hpc.kfac.forms.BlockDiagonalForm`), formed by one batched Gram per side
(:func:`~lightning_hpc.kfac.linalg.group_gram`), decomposed by one batched ``eigh`` / inverse and applied by one
batched product per side (:func:`~lightning_hpc.kfac.linalg.precondition_eigen`) to the stacked ``(groups, g_dim,
a_dim)`` gradient matrices. The ``C`` tiny blocks of a depthwise layer of ``C`` channels are thus one tensor per
factor and a few batched operations per step, not ``C`` layers' worth of hooks, decompositions and products.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from lightning_hpc.kfac.forms import BlockDiagonalForm, FactorForm
from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.conv import ConvHandler
from lightning_hpc.kfac.layers.transposed import ConvTransposeHandler
from lightning_hpc.kfac.linalg import cache_blocked, depthwise_patch_gram, group_gram

__all__ = ["GroupConvHandler", "GroupConvTransposeHandler"]


class _Grouped(LayerHandler):
    """The groups of a grouped (transposed) convolution as a stack of blocks: :attr:`a_dim` / :attr:`g_dim` are the
    sides of one group's A and G (put before the layer's handler in the bases). The statistics are the stacked
    grams of :meth:`input_gram` / :meth:`output_gram`; a group's rows are the ungrouped handler's
    :meth:`input_rows` / :meth:`output_rows` restricted to its channels."""

    in_per_group: int
    out_per_group: int

    def _set_groups(self, module: nn.Module) -> None:
        m = cast(Any, module)
        self.groups = int(m.groups)
        self.in_per_group = m.in_channels // m.groups
        self.out_per_group = m.out_channels // m.groups

    def factor_forms(self) -> dict[str, FactorForm]:
        """One KFC block per group: A and G stacked over the groups."""
        return {"A": BlockDiagonalForm(self.groups, self.a_dim), "G": BlockDiagonalForm(self.groups, self.g_dim)}

    @property
    def form_note(self) -> str:  # type: ignore[override]
        return f"{self.groups} groups: a Kronecker block per group"

    def _by_group(self, t: torch.Tensor) -> torch.Tensor:
        """``(N, C, ...)`` as ``(N, groups, C / groups, ...)`` (a view)."""
        return t.unflatten(1, (self.groups, -1))


class GroupConvHandler(_Grouped, ConvHandler):
    """A grouped convolution (``groups > 1``; depthwise when each group has one input channel).

    Group ``i``'s weights ``W[i Co/g : (i+1) Co/g]`` see only input channels ``[i Ci/g, (i+1) Ci/g)`` and produce
    only output channels ``[i Co/g, (i+1) Co/g)``: each group is a convolution of its own, and K-FAC gives it its
    own Kronecker block (KFC's factors of that sub-convolution, Grosse & Martens 2016, section 3.1), so the layer's
    curvature is block-diagonal over its groups, as K-FAC's is over layers (Martens & Grosse 2015, section 3). The
    gradient matrix is the stack over groups of each group's rows of ``[dW | db]``, ``(groups, Co/g, a_dim)``.

    A of every group comes from the unfolded patches (KFC's expansion operator) in one batched Gram; on CPU, a 2-D
    depthwise layer's (one input channel per group, undilated along the height) from the products of pairs of input
    rows instead (:func:`~lightning_hpc.kfac.linalg.depthwise_patch_gram`: a seventh of the multiply-adds for 7x7
    kernels, the same sums up to their order). The shifted channel correlations of
    :func:`~lightning_hpc.kfac.linalg.conv_patch_gram` are for ungrouped layers only.
    """

    refuses_split_input = True  # type: ignore[assignment]

    def __init__(self, name: str, module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> None:
        self._set_groups(module)
        super().__init__(name, module)

    @property
    def a_dim(self) -> int:
        return self.in_per_group * math.prod(self.module.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.out_per_group

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self.sample_subset(x)  # A is a mean over rows: a subset's mean estimates it without rescaling
        if self._row_pairs(x):
            return self._depthwise_gram(x)
        win, nd = self._windows(x), self.spatial_dims  # (N, C, *out, *kernel), a view: group_gram copies it
        rows = win.shape[0] * math.prod(win.shape[2 : 2 + nd])
        patches = win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))  # (N, C, *kernel, *out)
        gram, colsum = group_gram(self._by_group(patches), k_dims=1 + nd, colsum=self.has_bias)
        return self._fold_bias(gram, colsum, rows), rows

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return group_gram(self._by_group(self._batched(g.detach().to(self.dtype_for(g)))), k_dims=1)[0]

    def _row_pairs(self, x: torch.Tensor) -> bool:
        """A from :func:`~lightning_hpc.kfac.linalg.depthwise_patch_gram`: a 2-D layer with one input channel per
        group, undilated along the height, on CPU (its many small products suit one core's caches)."""
        return (self.spatial_dims == 2 and self.in_per_group == 1 and self.geometry.dilation[0] == 1
                and cache_blocked(x))

    def _depthwise_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        geo = self.geometry
        x = self._batched(x.detach().to(self.dtype_for(x)))
        left, right, top, bottom = geo.padding
        pads = (top, bottom, left, right)
        if geo.mode != "zeros":  # reflect / replicate / circular: the padded input, as the module's forward pads it
            x, pads = self._pad(x), (0, 0, 0, 0)
        kh, kw = self.module.kernel_size  # type: ignore[misc]  # 2-D (_row_pairs)
        gram, colsum = depthwise_patch_gram(x, (kh, kw), (geo.stride[0], geo.stride[1]), pads, geo.dilation[1],
                                            colsum=self.has_bias)
        h_out = (x.shape[2] + pads[0] + pads[1] - kh) // geo.stride[0] + 1
        w_out = (x.shape[3] + pads[2] + pads[3] - geo.dilation[1] * (kw - 1) - 1) // geo.stride[1] + 1
        rows = x.shape[0] * h_out * w_out
        return self._fold_bias(gram, colsum, rows), rows


class GroupConvTransposeHandler(_Grouped, ConvTransposeHandler):
    """A grouped transposed convolution (``groups > 1``).

    The weight is ``(C_in, C_out / groups, *kernel)``: group ``i``'s input channels ``[i C_in/g, (i+1) C_in/g)``
    scatter only into its output channels ``[i C_out/g, (i+1) C_out/g)``, so each group is a transposed
    convolution of its own and gets its own block of :class:`ConvTransposeHandler`'s swapped KFC form (Grosse &
    Martens 2016, section 3.1), as a grouped convolution's groups do (:class:`GroupConvHandler`). The gradient
    matrix is the stack over groups of each group's rows of ``dW`` viewed as ``(C_out/g * prod(kernel), C_in/g)``.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self._set_groups(module)
        super().__init__(name, module)

    @property
    def a_dim(self) -> int:
        return self.in_per_group

    @property
    def g_dim(self) -> int:
        return self.out_per_group * math.prod(self.module.kernel_size)

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self._batched(x.detach().to(self.dtype_for(x)))
        return group_gram(self._by_group(x), k_dims=1)[0], x.shape[0] * math.prod(x.shape[2:])

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        win, nd = self._output_windows(g), self.spatial_dims  # (N, C_out, *input positions, *kernel)
        windows = win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
        return group_gram(self._by_group(windows), k_dims=1 + nd)[0]
