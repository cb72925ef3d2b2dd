"""Spatially partitioned Conv2d with halo exchange (Dryden et al., section III-A, Eqs. 1-3; overlap IV-A).

Forward: each rank computes the output rows/columns of its (blocked) output tile.  It needs its input tile
plus a halo of exactly the rows/columns its output windows reach (:mod:`halo_exchange`); the image border
is zero padding.  Three paths, all equal to the serial layer; the first two are the N-d kernels of
:mod:`lightning_hpc.spatial.kernels.convolution` on this layer's (cached) halo plan:

* the in-place tile path (taken whenever each tile starts at a multiple of the stride and its output block is the
  native output of the tile, e.g. every layer of the mesh FCN on even extents): one native convolution of the
  tile itself, padded like the serial layer, gives every output whose window stays in the tile; only the edge
  rows/columns that read a neighbour's rows are recomputed from small boxes and written over it.  No copy of
  the tile in forward or backward.  ``overlap=True`` waits for the halo after the tile's convolution (and, in
  backward, for the halo gradients after the tile's convolution backward), ``overlap=False`` right away.
* otherwise, ``overlap=False`` (the default): the tile is copied into one box with its halo and the image-border
  zeros while the halo travels, and ONE native convolution runs on the box (the box path);
* otherwise, ``overlap=True``: the *interior* outputs are computed from the tile while the halo travels and the
  four boundary strips from small boxes once it arrived (five convolutions and two concatenations per layer).

Measured in docs/spatial.md.  Backward (autograd through the exchange): dL/dx of the halo goes back to its owner and is
added into its interior; dL/dw and dL/db are the local partial sums of Eq. 2 over this tile; they are summed
over the spatial group by the strategy (:func:`lightning_hpc.spatial.gradients.reduce_gradients`).

K-FAC extension point (:class:`lightning_hpc.kfac.layers.TiledConvHandler`): with ``kfac_record_input`` set
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

from lightning_hpc.spatial.halo_exchange import (
    HaloPlan,
    Window1d,
    finish_halo_exchange,
    own_slices,
    start_halo_exchange,
)
from lightning_hpc.spatial.kernels.convolution import (
    Region,
    convolution_windows,
    edge_regions,
    planned_convolution,
    tile_convolution_applies,
)
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialConv2d", "conv_windows", "tile_conv_applies"]


def _is_spatial(x) -> bool:
    from lightning_hpc.spatial.dispatch import SpatialTensor

    return isinstance(x, SpatialTensor)


def conv_windows(conv: nn.Conv2d) -> tuple[Window1d, Window1d]:
    """Per-dimension windows of a Conv2d (:func:`lightning_hpc.spatial.kernels.convolution_windows`; only zero
    padding, symmetric: an even kernel span with ``padding='same'`` is padded by the op dispatch first)."""
    wh, ww = convolution_windows(conv.weight.shape, conv.stride, conv.padding, conv.dilation)
    if not (wh.symmetric and ww.symmetric):
        raise ValueError(f"{conv}: padding='same' with an even kernel span is asymmetric; not supported spatially")
    return wh, ww


def tile_conv_applies(conv: nn.Conv2d, h: int, w: int, parts: tuple[int, ...]) -> bool:
    """Whether every tile of an ``h x w`` input split ``parts`` (blocked) takes the in-place tile path, which copies
    no tile-size box (for the planner's cost of the halo box copies)."""
    return tile_convolution_applies((h, w), parts, conv_windows(conv))


class SpatialConv2d(nn.Conv2d, SpatialLayer):
    """A Conv2d running on one spatial tile; shares its parameters with the layer it was made from."""

    overlap: bool
    _wins: tuple[Window1d, Window1d]
    _edge_cache: dict[tuple[int, int], list[tuple[Region, Region]] | None]
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

    def _record(self, padded: torch.Tensor, extent: tuple[int, ...]) -> None:
        if self.kfac_record_input:
            self.kfac_padded_input = padded.detach()
            self.kfac_output_extent = (int(extent[0]), int(extent[1]))

    @classmethod
    def from_module(cls, conv: nn.Conv2d, grid: SpatialGrid, *, overlap: bool = False, name: str = "") -> SpatialConv2d:
        if conv.padding_mode != "zeros":
            raise ValueError(
                f"Conv2d '{name}' uses padding_mode={conv.padding_mode!r}; the spatial layers implement zero padding "
                f"only (the image border is padded locally on the border tiles)"
            )
        new = copy.copy(conv)  # shallow: the same Parameter objects, so optimizers stay valid
        new.__class__ = cls
        assert isinstance(new, cls)
        new._init_spatial(grid, name)
        new.overlap = overlap
        new._wins = conv_windows(conv)
        new._edge_cache = {}
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
        if _is_spatial(x):
            return self.spatial_call(x)
        if self._serial_input(x):
            out = super().forward(x)
            if self.kfac_record_input:
                self._record(F.pad(x, self._reversed_padding_repeated_twice), out.shape[-2:])
            return out
        h, w = self.global_input_extent(x)
        return self.tile_forward(x, self.weight, self.bias, h, w)

    def tile_forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: int, w: int
    ) -> torch.Tensor:
        """This layer's convolution of the plain tile ``x`` of an ``h x w`` input with ``weight`` and ``bias``
        (the module's own, or those of a functional ``F.conv2d`` call dispatched by :mod:`dispatch`)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # as autocast casts a convolution's operands (bf16-mixed / 16-mixed): the custom autograd functions
            # below then save and differentiate in the same dtype the serial layer computes in
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return self.tile_forward(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), h, w)
        plan = self.halo_plan(h, w)
        record = self._record if self.kfac_record_input else None
        regions = None
        if record is None and not self.pointwise:  # (K-FAC capture steps need the padded box: the box path builds it)
            regions = self._edge_regions(h, w, plan)
        if regions is None and not self.pointwise and self.overlap and weight is self.weight and record is None:
            return self._forward_tiled(x, plan)
        path = "box" if regions is None else "auto"
        return planned_convolution(x, weight, bias, plan, self._wins, self.groups, path=path, overlap=self.overlap,
                                   record=record, regions=regions)

    def _edge_regions(self, h: int, w: int, plan: HaloPlan):
        """:func:`edge_regions` for an ``h x w`` input (``plan`` is :meth:`halo_plan` of it): a pure function of the
        extent for this layer, cached by it as the plans are."""
        cache = self._edge_cache
        if (h, w) not in cache:
            if len(cache) > 32:
                cache.clear()
            cache[(h, w)] = edge_regions(plan, self._wins)
        return cache[(h, w)]

    def _forward_tiled(self, x: torch.Tensor, plan) -> torch.Tensor:
        """Interior outputs straight from the tile (no copy), the four boundary strips from small boxes that
        combine tile rows, received halo blocks and the zero padding of the image border; the interior is computed
        while the halos travel (``overlap=True``, section IV-A; ``overlap=False`` takes :class:`_HaloConv2d`)."""
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
        boxes: list[tuple[int, int, int, int] | None] = []
        for o0, o1, q0, q1 in regions:
            if o1 <= o0 or q1 <= q0:
                boxes.append(None)
                continue
            boxes.append((*wh.needed(o0, o1, plan.rows.n), *ww.needed(q0, q1, plan.cols.n)))
        xs, exchange = start_halo_exchange(x, plan)
        owns = own_slices(xs, plan, [bx if bx is not None else (0, 0, 0, 0) for bx in boxes])
        outs: list[torch.Tensor | None] = [None] * 5
        if boxes[0] is not None:  # interior: only this tile's rows, computed while the halos travel
            assert owns[0] is not None  # the interior's input box lies inside the tile
            outs[0] = self._conv(owns[0])
        halo = finish_halo_exchange(xs, exchange)
        if self.kfac_record_input:  # the whole padded input box of the output tile (a copy, capture steps only)
            (r0, r1), (c0, c1) = plan.need
            with torch.no_grad():
                self._record(halo.box(r0, r1, c0, c1), (plan.rows.n_out, plan.cols.n_out))
        for k in range(1, 5):
            box = boxes[k]
            if box is not None:
                outs[k] = self._conv(halo.box(*box, own=owns[k]))
        middle = [t for t in (outs[3], outs[0], outs[4]) if t is not None]
        rows = [outs[1], torch.cat(middle, dim=3) if len(middle) > 1 else (middle[0] if middle else None), outs[2]]
        present = [t for t in rows if t is not None]
        return torch.cat(present, dim=2) if len(present) > 1 else present[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", spatial_parts={self.grid.parts}, overlap={self.overlap}"
