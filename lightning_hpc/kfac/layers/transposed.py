"""K-FAC for transposed convolutions (``nn.ConvTranspose1d/2d/3d`` with one group): KFC's form (Grosse & Martens
2016, section 3.1) with its two sides swapped, A from the input channels at the input positions, G from the
output-gradient windows each input position scatters into; the bias is left to the optimizer.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.conv import sliding_windows
from lightning_hpc.kfac.linalg import sym_gram

__all__ = ["TRANSPOSED_CONVOLUTIONS", "ConvTransposeHandler"]

#: the transposed convolutions K-FAC preconditions (grouped ones by :class:`~.grouped.GroupConvTransposeHandler`)
TRANSPOSED_CONVOLUTIONS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class ConvTransposeHandler(LayerHandler):
    """``nn.ConvTranspose1d/2d/3d`` with groups=1 (U-Net decoders), any stride / padding / output padding / dilation.

    A transposed convolution scatters each *input* position ``t`` into an output window: with ``w_t`` the output
    gradient in that window (``C_out * prod(kernel)`` values, the patches of ``dL/dy`` under the convolution that is
    the layer's adjoint: same kernel, stride, padding, dilation), ``dW = sum_n sum_t x_t w_t^T`` for the weight
    ``(C_in, C_out, *kernel)``. That is KFC's form (Grosse & Martens 2016, section 3.1) with the roles of the two
    sides swapped: A is the input at the input positions, ``1/(B T) sum x x^T`` (``C_in`` square, T the input
    positions), G the output-gradient windows, ``B sum_n sum_t w w^T``. The gradient matrix is ``dW`` viewed as
    ``(C_out * prod(kernel), C_in)``. The bias (one value per output channel, summed over every output position) is
    not of that form: it is left to the optimizer.
    """

    module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
    refuses_split_input = True

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self.has_bias = False  # left to the optimizer (see the class docstring)

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    @property
    def a_dim(self) -> int:
        return self.module.in_channels

    @property
    def g_dim(self) -> int:
        return self.module.out_channels * math.prod(self.module.kernel_size)

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if t.dim() == self.spatial_dims + 1 else t

    def _output_windows(self, g: torch.Tensor) -> torch.Tensor:
        """``(N, C_out, *input positions, *kernel)``: the output gradient seen by each input position."""
        m = self.module
        g = self._batched(g.detach().to(self.dtype_for(g)))
        pads = cast(tuple[int, ...], m.padding)  # a transposed convolution's padding is always numbers
        g = F.pad(g, [p for p in reversed(pads) for _ in range(2)])
        return sliding_windows(g, m.kernel_size, m.stride, m.dilation)

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        x = self._batched(x.detach().to(self.dtype_for(x)))
        return x.movedim(1, -1).reshape(-1, x.shape[1])

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        win, nd = self._output_windows(g), self.spatial_dims
        return win.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)).reshape(-1, self.g_dim)

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self._batched(x.detach().to(self.dtype_for(x)))
        return sym_gram(x, k_dims=1)[0], x.shape[0] * math.prod(x.shape[2:])

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        win, nd = self._output_windows(g), self.spatial_dims
        return sym_gram(win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)), k_dims=1 + nd)[0]

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        return None if w.grad is None else w.grad.reshape(*self.grad_shape[:-2], self.a_dim, -1).mT

    def grad_views(self, mat: torch.Tensor) -> list[torch.Tensor] | None:
        return [mat.mT.view(self.weight.shape)]  # no bias (left to the optimizer)

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad.copy_(mat.mT.reshape_as(w.grad))
