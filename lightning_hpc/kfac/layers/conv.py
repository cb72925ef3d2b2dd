"""K-FAC for convolutions (``nn.Conv1d/2d/3d`` with one group): KFC's factors (Grosse & Martens 2016, section
3.1), A from the unfolded input patches (KFC's expansion operator) averaged over samples and output positions, G from
the output gradients summed over positions. On CPU, A of a stride-1 zero-padded 2-D convolution comes from shifted
channel correlations (:func:`~lightning_hpc.kfac.linalg.conv_patch_gram`) once the layer has enough work
(:data:`SHIFTED_GRAM_MIN_WORK`). Grouped convolutions are in :mod:`.grouped`, tiled ones in :mod:`.tiled`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.linalg import cache_blocked, conv_patch_gram, sym_gram
from lightning_hpc.kfac.subclasses import ConvGeometry

__all__ = ["CONVOLUTIONS", "SHIFTED_GRAM_MIN_WORK", "ConvHandler", "sliding_windows"]

#: least ``output positions x a_dim^2`` (the multiply-adds of the plain Gram) for which a convolution's A is
#: computed from channel correlations: below it the unfolded patches' single product is cheaper (measured at
#: 1 thread: 32 samples of 8 channels at 8x8, 3x3 kernel, 0.36 ms unfolded against 0.69 ms; ResNet-32's layers
#: at batch 128 (about 2.7e9) take less than half the time of the symmetric product of the patches)
SHIFTED_GRAM_MIN_WORK = 1 << 25


def sliding_windows(t: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
                    dilation: tuple[int, ...]) -> torch.Tensor:
    """Strided view ``(N, C, *positions, *kernel)`` of a padded ``(N, C, *spatial)`` tensor: the windows of a
    convolution with these kernel sizes, strides and dilations (every ``d``-th element of a ``d (k - 1) + 1`` span),
    without copying."""
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        t = t.unfold(2 + i, d * (k - 1) + 1, s)
    return t[(...,) + tuple(slice(None, None, d) for d in dilation)]


#: the convolutions K-FAC preconditions: one handler for 1, 2 and 3 spatial dimensions (grouped ones by
#: :class:`GroupConvHandler`)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class ConvHandler(LayerHandler):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` with groups=1, any stride / padding (incl. 'same' and non-zero
    padding modes) / dilation.

    A uses the unfolded input patches (KFC's expansion operator, Grosse & Martens 2016, section 3.1, for any
    number of spatial dimensions: the positions ``t`` run over the whole output grid), ordered like
    ``weight.view(out, -1)``; G the output gradients at every position.
    """

    module: nn.Conv1d | nn.Conv2d | nn.Conv3d

    #: fraction of each captured batch whose input patches form A (1.0: every sample, KFC's definition). Below 1,
    #: a random subset of ``ceil(fraction * N)`` samples is drawn from :attr:`generator` (see
    #: ``KFACPreconditioner(conv_input_sample_fraction=...)``); G always uses the whole batch.
    sample_fraction: float = 1.0
    generator: torch.Generator | None = None
    #: A of stride-1 zero-padded 2-D convolutions from channel correlations (:meth:`_shifted_padding`); False for
    #: inputs that come padded already (:class:`TiledConvHandler`)
    shifted_gram: bool = True

    #: the geometry of the call being captured (a subclass's own forward, :mod:`~lightning_hpc.kfac.subclasses`);
    #: None: the module's own (``nn.ConvNd.forward``)
    call_geometry: ConvGeometry | None = None

    @property
    def geometry(self) -> ConvGeometry:
        """Stride, dilation and padding the captured input went through: the captured call's, else the module's."""
        return self.call_geometry or ConvGeometry.of_module(self.module)

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    #: one tile of a split activation has statistics only through the tiled handler (a convolution the spatial
    #: strategy declared, :class:`TiledConvHandler`); a plain handler would take one tile's factors for the sample's
    refuses_split_input = True  # type: ignore[assignment]

    @property
    def a_dim(self) -> int:
        m = self.module
        return m.in_channels * math.prod(m.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if t.dim() == self.spatial_dims + 1 else t  # an unbatched input is one sample

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """Strided view ``(N, C, *out, *kernel)`` of the padded input: the patches without copying.

        Padding (zeros, 'same', reflect/replicate/circular) is applied exactly as the module's forward does;
        dilation takes every ``d``-th element of a ``d (k - 1) + 1`` window. One later copy lays the patches out
        as needed, about 40% cheaper on CPU than ``F.unfold`` (im2col) followed by a transposed copy.
        """
        geo = self.geometry
        return sliding_windows(self._pad(self._batched(x.detach().to(self.dtype_for(x)))), self.module.kernel_size,
                               geo.stride, geo.dilation)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        geo = self.geometry
        if any(geo.padding):
            x = F.pad(x, geo.padding, mode="constant" if geo.mode == "zeros" else geo.mode)
        return x

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        win, nd = self._windows(x), self.spatial_dims
        positions = tuple(range(2, 2 + nd))
        kernel = tuple(range(2 + nd, 2 + 2 * nd))
        rows = win.permute(0, *positions, 1, *kernel)
        return self._with_bias(rows.reshape(-1, win.shape[1] * math.prod(win.shape[2 + nd:])))

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        g = self._batched(g.detach().to(self.dtype_for(g)))
        return g.movedim(1, -1).reshape(-1, g.shape[1])

    def sample_subset(self, x: torch.Tensor) -> torch.Tensor:
        """The samples of ``x`` whose patches form A: all of them unless :attr:`sample_fraction` < 1, else a
        random subset (sorted indices, so a subset that covers the batch is the batch itself)."""
        if self.sample_fraction >= 1.0 or x.dim() != self.spatial_dims + 2:
            return x
        n = x.shape[0]
        keep = max(1, math.ceil(self.sample_fraction * n))
        if keep >= n:
            return x
        idx = torch.randperm(n, generator=self.generator)[:keep].sort().values
        return x.index_select(0, idx.to(x.device))

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self.sample_subset(x)  # A is a mean over rows: a subset's mean estimates it without rescaling
        pads = self._shifted_padding(x)
        if pads is not None:  # stride 1, zero padding: from channel correlations, no patches formed
            xs = self._batched(x.detach().to(self.dtype_for(x)))
            rows = self._positions(xs, pads)
            kh, kw = self.module.kernel_size  # type: ignore[misc]  # 2-D only (_shifted_padding)
            gram = conv_patch_gram(xs, (kh, kw), pads)
            colsum = self._windows(x).sum(dim=(0, 2, 3)).reshape(-1) if self.has_bias else None
            return self._fold_bias(gram, colsum, rows), rows
        win, nd = self._windows(x), self.spatial_dims  # (N, C, *out, *kernel), a view: sym_gram copies it in chunks
        rows = win.shape[0] * math.prod(win.shape[2 : 2 + nd])
        patches = win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))  # (N, C, *kernel, *out)
        gram, colsum = sym_gram(patches, k_dims=1 + nd, colsum=self.has_bias)
        return self._fold_bias(gram, colsum, rows), rows

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(self._batched(g.detach().to(self.dtype_for(g))), k_dims=1)[0]

    def _shifted_padding(self, x: torch.Tensor) -> tuple[int, int, int, int] | None:
        """``(top, bottom, left, right)`` zero padding when A is computed by
        :func:`~lightning_hpc.kfac.linalg.conv_patch_gram` (stride 1, no dilation, zero padding of at most
        ``k - 1``, a kernel larger than 1x1, on CPU, and enough work: below :data:`SHIFTED_GRAM_MIN_WORK` its
        fixed cost of some 30 small products exceeds what it saves); else None (the unfolded patches)."""
        geo = self.geometry
        if self.spatial_dims != 2:
            return None
        (kh, kw), (left, right, top, bottom) = self.module.kernel_size, geo.padding  # type: ignore[misc]
        if (not self.shifted_gram or not cache_blocked(x) or x.dim() not in (3, 4) or kh * kw == 1
                or geo.stride != (1, 1) or geo.dilation != (1, 1) or geo.mode != "zeros"
                or max(top, bottom) >= kh or max(left, right) >= kw):  # fmt: skip
            return None
        pads = top, bottom, left, right
        return pads if self._positions(x, pads) * self.a_dim**2 >= SHIFTED_GRAM_MIN_WORK else None

    def _positions(self, x: torch.Tensor, pads: tuple[int, int, int, int]) -> int:
        """Output positions of all samples of ``x`` (batched or not) at stride 1 with ``(top, bottom, left,
        right)`` padding."""
        (kh, kw), (top, bottom, left, right) = self.module.kernel_size, pads  # type: ignore[misc]
        n = x.shape[0] if x.dim() == 4 else 1
        return n * (x.shape[-2] + top + bottom - kh + 1) * (x.shape[-1] + left + right - kw + 1)
