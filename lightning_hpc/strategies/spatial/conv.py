"""Spatially partitioned Conv2d with halo exchange (Dryden et al., section III-A, Eqs. 1-3; overlap IV-A).

Forward: each rank computes the output rows/columns of its (blocked) output tile.  It needs its input tile
plus a halo of exactly the rows/columns its output windows reach (:mod:`halo_exchange`); the image border
is zero padding.  With ``overlap=True`` the halo messages are posted first, the *interior* outputs (whose
windows lie inside the local tile) are computed while they travel, and the four boundary strips are computed
once they arrived.  Backward (autograd through the exchange): dL/dx of the halo goes back to its owner and is
added into its interior; dL/dw and dL/db are the local partial sums of Eq. 2 over this tile; they are summed
over the spatial group by the strategy (:func:`lightning_hpc.strategies.spatial.gradients.reduce_gradients`).

K-FAC extension point (:class:`lightning_hpc.kfac.layers.TiledConv2dHandler`): with ``kfac_record_input`` set
before a forward, the layer keeps the halo-padded input tile its output tile is computed from
(``kfac_padded_input``: a convolution with padding 0 of it gives exactly the output positions this tile owns, so
its unfolded patches are this tile's share of KFC's expansion) and the global output extent
(``kfac_output_extent``, for the whole-sample normalisation).  ``kfac_partition_size`` tiles make up a sample.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.strategies.spatial.halo_exchange import Window1d, finish_halo_exchange, own_slices, start_halo_exchange
from lightning_hpc.strategies.spatial.layer import SpatialLayer
from lightning_hpc.strategies.spatial.tiling import SpatialGrid

__all__ = ["SpatialConv2d", "conv_windows"]


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_windows(conv: nn.Conv2d) -> tuple[Window1d, Window1d]:
    """Per-dimension windows of a Conv2d (string paddings resolved; only zero padding is supported)."""
    k, s, d = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            p = (0, 0)
        else:  # "same" (stride 1 only in torch): symmetric when the dilated kernel is odd
            spans = [d[i] * (k[i] - 1) for i in range(2)]
            if any(sp % 2 for sp in spans):
                raise ValueError(f"{conv}: padding='same' with an even kernel span is asymmetric; not supported spatially")
            p = (spans[0] // 2, spans[1] // 2)
    else:
        p = _pair(conv.padding)
    return Window1d(k[0], s[0], p[0], d[0]), Window1d(k[1], s[1], p[1], d[1])


class SpatialConv2d(nn.Conv2d, SpatialLayer):
    """A Conv2d running on one spatial tile; shares its parameters with the layer it was made from."""

    overlap: bool
    #: K-FAC extension point (module docstring): set by K-FAC before a forward whose statistics it captures
    kfac_record_input: bool = False
    #: the halo- and border-padded input tile of the last recorded forward (detached), else None
    kfac_padded_input: torch.Tensor | None = None
    #: global (H_out, W_out) of the last recorded forward
    kfac_output_extent: tuple[int, int] | None = None

    @property
    def kfac_partition_size(self) -> int:
        """Ranks whose tiles make up one sample: their K-FAC factors are partial sums over this many ranks."""
        return self.grid.size

    def _record(self, padded: torch.Tensor, extent: tuple[int, int]) -> None:
        if self.kfac_record_input:
            self.kfac_padded_input = padded.detach()
            self.kfac_output_extent = (int(extent[0]), int(extent[1]))

    @classmethod
    def from_module(cls, conv: nn.Conv2d, grid: SpatialGrid, *, overlap: bool = True, name: str = "") -> "SpatialConv2d":
        if conv.padding_mode != "zeros":
            raise ValueError(
                f"Conv2d '{name}' uses padding_mode={conv.padding_mode!r}; the spatial layers implement zero padding "
                f"only (the image border is padded locally on the border tiles)"
            )
        new = copy.copy(conv)  # shallow: the same Parameter objects, so optimizers stay valid
        new.__class__ = cls
        new._init_spatial(grid, name)
        new.overlap = overlap
        new._wins = conv_windows(conv)
        return new

    def windows(self, h: int, w: int):
        return self._wins

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding: output tile = input tile, no halo at all."""
        return all(win.kernel == 1 and win.stride == 1 and win.padding == 0 for win in self._wins)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.grid.size == 1:
            out = super().forward(x)
            if self.kfac_record_input:
                self._record(F.pad(x, self._reversed_padding_repeated_twice), out.shape[-2:])
            return out
        h, w = self.global_input_extent(x)
        plan = self.halo_plan(h, w)
        if self.pointwise:
            self._record(x, (plan.rows.n_out, plan.cols.n_out))
            return self._conv(x)
        return self._forward_tiled(x, plan)

    def _forward_tiled(self, x: torch.Tensor, plan) -> torch.Tensor:
        """Interior outputs straight from the tile (no copy), the four boundary strips from small boxes that
        combine tile rows, received halo blocks and the zero padding of the image border.  With overlap the
        interior is computed while the halos travel; without, after they arrived (same arithmetic)."""
        wh, ww = self._wins
        (a, b), (c, e) = plan.own
        (oa, ob), (oc, oe) = plan.out
        ia, ib = wh.outputs_within(a, b)
        ja, jb = ww.outputs_within(c, e)
        ia, ib = max(ia, oa), min(ib, ob)
        ja, jb = max(ja, oc), min(jb, oe)
        if ib <= ia or jb <= ja:  # no interior: everything is boundary
            ia = ib = oa
            ja = jb = oc
        # the input box of every output region: interior first, then the strips (top, bottom, left, right)
        regions = [(ia, ib, ja, jb), (oa, ia, oc, oe), (ib, ob, oc, oe), (ia, ib, oc, ja), (ia, ib, jb, oe)]
        boxes = []
        for o0, o1, q0, q1 in regions:
            if o1 <= o0 or q1 <= q0:
                boxes.append(None)
                continue
            boxes.append((*wh.needed(o0, o1, plan.rows.n), *ww.needed(q0, q1, plan.cols.n)))
        xs, exchange = start_halo_exchange(x, plan)
        owns = own_slices(xs, plan, [bx if bx is not None else (0, 0, 0, 0) for bx in boxes])
        halo = None if self.overlap else finish_halo_exchange(xs, exchange)
        outs: list[torch.Tensor | None] = [None] * 5
        if boxes[0] is not None:  # interior: only this tile's rows, computed while the halos travel
            outs[0] = self._conv(owns[0])
        if halo is None:
            halo = finish_halo_exchange(xs, exchange)
        if self.kfac_record_input:  # the whole padded input box of the output tile (a copy, capture steps only)
            (r0, r1), (c0, c1) = plan.need
            with torch.no_grad():
                self._record(halo.box(r0, r1, c0, c1), (plan.rows.n_out, plan.cols.n_out))
        for k in range(1, 5):
            if boxes[k] is not None:
                outs[k] = self._conv(halo.box(*boxes[k], own=owns[k]))
        middle = [t for t in (outs[3], outs[0], outs[4]) if t is not None]
        rows = [outs[1], torch.cat(middle, dim=3) if len(middle) > 1 else (middle[0] if middle else None), outs[2]]
        rows = [t for t in rows if t is not None]
        return torch.cat(rows, dim=2) if len(rows) > 1 else rows[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", spatial_parts={self.grid.parts}, overlap={self.overlap}"
