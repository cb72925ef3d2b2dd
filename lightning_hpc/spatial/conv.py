"""Spatially partitioned Conv2d with halo exchange (Dryden et al., section III-A, Eqs. 1-3; overlap IV-A).

Forward: each rank computes the output rows/columns of its (blocked) output tile.  It needs its input tile
plus a halo of exactly the rows/columns its output windows reach (:mod:`halo_exchange`); the image border
is zero padding.  Three paths, all equal to the serial layer:

* :class:`_TileConv2d` (taken whenever each tile starts at a multiple of the stride and its output block is the
  native output of the tile, e.g. every layer of the mesh FCN on even extents): one native convolution of the
  tile itself, padded like the serial layer, gives every output whose window stays in the tile; only the edge
  rows/columns that read a neighbour's rows are recomputed from small boxes and written over it.  No copy of
  the tile in forward or backward.  ``overlap=True`` waits for the halo after the tile's convolution (and, in
  backward, for the halo gradients after the tile's convolution backward), ``overlap=False`` right away.
* otherwise, ``overlap=False`` (the default): the tile is copied into one box with its halo and the image-border
  zeros while the halo travels, and ONE native convolution runs on the box (:class:`_HaloConv2d`);
* otherwise, ``overlap=True``: the *interior* outputs are computed from the tile while the halo travels and the
  four boundary strips from small boxes once it arrived (five convolutions and two concatenations per layer).

Measured in docs/spatial.md.  Backward (autograd through the exchange): dL/dx of the halo goes back to its owner and is
added into its interior; dL/dw and dL/db are the local partial sums of Eq. 2 over this tile; they are summed
over the spatial group by the strategy (:func:`lightning_hpc.spatial.gradients.reduce_gradients`).

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
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.halo_exchange import (
    Halo,
    HaloExchange,
    HaloPlan,
    Window1d,
    finish_halo_exchange,
    own_slices,
    start_halo_exchange,
)
from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialConv2d", "conv_windows", "extended_box", "native_padding"]


def _is_spatial(x) -> bool:
    from lightning_hpc.spatial.dispatch import SpatialTensor

    return isinstance(x, SpatialTensor)


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
                raise ValueError(
                    f"{conv}: padding='same' with an even kernel span is asymmetric; not supported spatially"
                )
            p = (spans[0] // 2, spans[1] // 2)
    else:
        p = _pair(conv.padding)
    return Window1d(k[0], s[0], p[0], d[0]), Window1d(k[1], s[1], p[1], d[1])


def native_padding(plan: HaloPlan, windows: tuple[Window1d, Window1d], grid_parts: tuple[int, ...]) -> tuple[int, int]:
    """Per dimension, the zero padding the native convolution applies itself: along a dimension that is not
    split (one part) the tile is the whole image, so the box spans it and the convolution pads it exactly as the
    serial layer does (no padding strips to fill, whole-row copies)."""
    pads = tuple(win.padding if parts == 1 else 0 for win, parts in zip(windows, grid_parts))
    return pads  # type: ignore[return-value]


def _box_ranges(plan: HaloPlan, native: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global row and column range of the box: the needed range, or the whole image along a dimension the
    convolution pads natively."""
    ranges = tuple((0, dim.n) if p else need for need, p, dim in zip(plan.need, native, (plan.rows, plan.cols)))
    return ranges  # type: ignore[return-value]


def _own_part(plan: HaloPlan, box: tuple[tuple[int, int], tuple[int, int]]) -> tuple[int, int, int, int]:
    """Global rows/columns of this tile that lie in the box (a strided kernel may not read a tile's last rows)."""
    (a, b), (c, e) = plan.own
    (br0, br1), (bc0, bc1) = box
    return max(a, br0), min(b, br1), max(c, bc0), min(e, bc1)


def extended_box(x: torch.Tensor, blocks: list[torch.Tensor], plan: HaloPlan, out: torch.Tensor | None = None,
                 own: bool = True, native: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The input box ``plan.need`` of this tile in one buffer: the tile's rows/columns it uses, the received halo
    blocks (in ``plan.recvs`` order) and zeros for the image border (except the ``native`` border the
    convolution pads itself).  Each element is written once (no zero-fill of the whole box, no concatenation).
    ``own=False`` leaves the tile's part to a later call."""
    box = _box_ranges(plan, native)
    (rlo, rhi), (clo, chi) = box
    if out is None:
        out = x.new_empty(x.shape[0], x.shape[1], rhi - rlo, chi - clo)
        (crlo, crhi), (cclo, cchi) = plan.need_clamped
        # image border: zero padding (only the strips outside the image)
        if crlo > rlo:
            out[:, :, : crlo - rlo].zero_()
        if rhi > crhi:
            out[:, :, crhi - rlo :].zero_()
        if cclo > clo:
            out[:, :, :, : cclo - clo].zero_()
        if chi > cchi:
            out[:, :, :, cchi - clo :].zero_()
    if own:
        (a, _), (c, _) = plan.own
        r0, r1, c0, c1 = _own_part(plan, box)
        out[:, :, r0 - rlo : r1 - rlo, c0 - clo : c1 - clo].copy_(x[:, :, r0 - a : r1 - a, c0 - c : c1 - c])
    for (_, _, (r0, r1), (c0, c1)), buf in zip(plan.recvs, blocks):
        out[:, :, r0 - rlo : r1 - rlo, c0 - clo : c1 - clo].copy_(buf)
    return out


def _grad_mask(ctx) -> tuple[bool, bool, bool]:
    """Which of (input, weight, bias) gradients a convolution node must produce."""
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]


Region = tuple[int, int, int, int]  # global (o0, o1, q0, q1): output rows [o0, o1) x columns [q0, q1)


def edge_regions(plan: HaloPlan, windows: tuple[Window1d, Window1d]) -> list[tuple[Region, Region]] | None:
    """For :class:`_TileConv2d`: the output regions of this tile whose windows read halo rows/columns, each with
    its (global) input box, or ``None`` when the tile cannot be convolved in place.

    A native convolution of the tile alone with the layer's own padding ``p`` computes, at local output ``k``,
    the window starting at global input ``a + k*s - p`` (``a`` the tile's first row).  That is global output
    ``k + a/s`` exactly when ``s`` divides ``a``, and the tile's output block is then the native output if
    it starts at ``a/s`` and has the native count.  Every output whose window stays inside the tile (or reads
    only the image border's zero padding, on a border tile) is then already right; the rest, at most a few
    rows/columns along each split edge, read the neighbours' rows and are recomputed from small boxes
    (top and bottom strips over the whole width, left and right strips over the rows in between)."""
    ranges = [
        _tile_outputs(win, own, out, dim.n)
        for dim, win, own, out in zip((plan.rows, plan.cols), windows, plan.own, plan.out)
    ]
    if None in ranges:
        return None
    (oa, ia, ib, ob), (oc, ja, jb, oe) = ranges  # type: ignore[misc]
    regions = [(oa, ia, oc, oe), (ib, ob, oc, oe), (ia, ib, oc, ja), (ia, ib, jb, oe)]
    wh, ww = windows
    return [((o0, o1, q0, q1), (*wh.needed(o0, o1, plan.rows.n), *ww.needed(q0, q1, plan.cols.n)))
            for (o0, o1, q0, q1) in regions if o1 > o0 and q1 > q0]


def _tile_outputs(
    win: Window1d, own: tuple[int, int], out: tuple[int, int], n: int
) -> tuple[int, int, int, int] | None:
    """Along one dimension of extent ``n``: for a tile owning input ``[a, b)`` and output ``[oa, ob)``, the output
    ranges ``(oa, ia, ib, ob)`` whose ``[ia, ib)`` the tile's own convolution already gets right (see
    :func:`edge_regions`), or ``None`` when the tile cannot be convolved in place."""
    (a, b), (oa, ob) = own, out
    length = b - a
    if length + 2 * win.padding < win.span or a % win.stride:
        return None
    native = (length + 2 * win.padding - win.span) // win.stride + 1
    if oa != a // win.stride or ob - oa != native:
        return None
    first, stop = win.outputs_within(a, b)
    ia = oa if a == 0 else max(oa, first)
    ib = ob if b == n else min(ob, stop)
    return None if ib < ia else (oa, ia, ib, ob)


def tile_conv_applies(conv: nn.Conv2d, h: int, w: int, parts: tuple[int, int]) -> bool:
    """Whether every tile of an ``h x w`` input split ``parts`` (blocked) takes the in-place :class:`_TileConv2d`
    path, which copies no tile-size box (for the planner's cost of the halo box copies)."""
    for win, n, p in zip(conv_windows(conv), (h, w), parts):
        outs = block_bounds(win.out_size(n), p)
        if any(_tile_outputs(win, own, out, n) is None for own, out in zip(block_bounds(n, p), outs)):
            return False
    return True


class _TileConv2d(torch.autograd.Function):
    """Halo exchange + convolution without copying the tile (section III-A; overlap per section IV-A).

    Forward: ONE native convolution of the tile itself with the layer's padding (no box, no copy) gives every
    output whose window stays inside the tile; the few edge rows/columns whose windows reach into a
    neighbour's tile (:func:`edge_regions`) are recomputed from small boxes (tile edge + received halo +
    border zeros) and written over it.  With ``overlap`` the halo travels during the big convolution.

    Backward, with ``B0`` an edge box as the tile convolution saw it (halo zeroed) and ``H = B - B0`` its halo
    part: ``y_edge = conv(B0) + conv(H)`` (linear), so the tile convolution's backward over the whole output
    gradient gives the tile's input gradient and the weight gradient for ``B0``; the edge boxes add
    ``dL/dw += conv_w_grad(g_edge, H)`` and the halo gradients ``conv_in_grad(g_edge, w)`` on ``H``'s halo
    entries, which go back to their owners (posted before the tile's backward, so they travel while it runs)
    and are added into the owners' edge rows.  Nothing the size of the tile is copied in either direction."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv: SpatialConv2d, plan: HaloPlan, regions):  # type: ignore[override]
        exchange = HaloExchange(plan)
        exchange.post_forward(x)
        padding = tuple(win.padding for win in conv._wins)
        blocks = None if conv.overlap else exchange.finish_forward()
        y = F.conv2d(x, weight, bias, conv.stride, padding, conv.dilation, conv.groups)
        if blocks is None:
            blocks = exchange.finish_forward()
        halo = Halo.from_blocks(x, blocks, plan)
        (oa, _), (oc, _) = plan.out
        for (o0, o1, q0, q1), box in regions:
            y[:, :, o0 - oa : o1 - oa, q0 - oc : q1 - oc] = F.conv2d(
                halo.box(*box), weight, bias, conv.stride, 0, conv.dilation, conv.groups
            )
        ctx.save_for_backward(x, weight, *blocks)
        ctx.exchange, ctx.plan, ctx.conv, ctx.regions, ctx.has_bias = exchange, plan, conv, regions, bias is not None
        return y

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, *blocks = ctx.saved_tensors
        plan, conv = ctx.plan, ctx.conv
        need_x, need_w, need_b = _grad_mask(ctx)
        halo = Halo.from_blocks(x, blocks, plan)
        (oa, _), (oc, _) = plan.out
        halo_grads = [torch.zeros_like(b) for b in blocks] if need_x else []
        grad_w_edges = []
        for (o0, o1, q0, q1), (r0, r1, c0, c1) in ctx.regions:
            g = grad_out[:, :, o0 - oa : o1 - oa, q0 - oc : q1 - oc]
            grad_box, grad_w, _ = torch.ops.aten.convolution_backward(
                g, halo.box(r0, r1, c0, c1, own_zero=True), weight, None, conv.stride, [0, 0], conv.dilation, False,
                [0, 0], conv.groups, [need_x, need_w, False])
            if need_w:
                grad_w_edges.append(grad_w)
            for (_, _, (br0, br1), (bc0, bc1)), hg in zip(plan.recvs, halo_grads):  # box part on each received block
                ra, rb, ca, cb = max(br0, r0), min(br1, r1), max(bc0, c0), min(bc1, c1)
                if rb > ra and cb > ca:
                    hg[:, :, ra - br0 : rb - br0, ca - bc0 : cb - bc0] += grad_box[
                        :, :, ra - r0 : rb - r0, ca - c0 : cb - c0
                    ]
        ex = ctx.exchange
        if need_x:  # every rank of the group agrees (same layer), so either all exchange or none does
            ex.post_backward(halo_grads)
            if not conv.overlap:
                ex.wait()
        padding = [win.padding for win in conv._wins]
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_out, x, weight, [weight.shape[0]] if ctx.has_bias else None, conv.stride, padding, conv.dilation,
            False, [0, 0], conv.groups, [need_x, need_w, need_b])
        if need_w:
            for gw in grad_w_edges:
                grad_w += gw
        if need_x:
            grad_x = ex.finish_backward(grad_x, inplace=True)
        return grad_x, grad_w if need_w else None, grad_b, None, None, None


class _HaloConv2d(torch.autograd.Function):
    """Halo exchange + convolution of one tile as one autograd node (``overlap=False``, section III-A).

    Forward posts the halo messages, copies the tile into the extended box while they travel, adds the halos
    and the image-border zeros, and runs ONE native convolution (padding only along a dimension that is not
    split, where the box is the whole image).  Only the tile and the (small) halo blocks are saved; backward
    rebuilds the box (one copy), runs the native convolution backward, posts the halo gradients back to their
    owners first and adds the gradients received from the neighbours into the tile's edge rows/columns in
    place (the adjoint of the forward exchange).  The tile's gradient is returned as a view of the box's
    gradient (no copy; the next kernel reads it strided)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv: SpatialConv2d, plan: HaloPlan):  # type: ignore[override]
        native = native_padding(plan, conv._wins, conv.grid.parts)
        exchange = HaloExchange(plan)
        exchange.post_forward(x)
        box = extended_box(x, [], plan, native=native)  # tile copied while the halos travel
        blocks = exchange.finish_forward()
        extended_box(x, blocks, plan, out=box, own=False, native=native)
        y = F.conv2d(box, weight, bias, conv.stride, native, conv.dilation, conv.groups)
        if conv.kfac_record_input:  # K-FAC's patches need the box with the native padding made explicit
            ph, pw = native
            conv._record(F.pad(box, (pw, pw, ph, ph)) if ph or pw else box, (plan.rows.n_out, plan.cols.n_out))
        ctx.save_for_backward(x, weight, *blocks)
        ctx.exchange, ctx.plan, ctx.conv, ctx.native, ctx.has_bias = exchange, plan, conv, native, bias is not None
        return y

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, *blocks = ctx.saved_tensors
        plan, conv, native = ctx.plan, ctx.conv, ctx.native
        need_x, need_w, need_b = _grad_mask(ctx)
        box = extended_box(x, blocks, plan, native=native)
        grad_box, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_out,
            box,
            weight,
            [weight.shape[0]] if ctx.has_bias else None,
            conv.stride,
            list(native),
            conv.dilation,
            False,
            [0, 0],
            conv.groups,
            [need_x, need_w, need_b],
        )
        del box
        grad_x = None
        if need_x:  # every rank of the group agrees (same layer), so either all exchange or none does
            box_ranges = _box_ranges(plan, native)
            (rlo, _), (clo, _) = box_ranges
            ex = ctx.exchange
            ex.post_backward(
                [grad_box[:, :, r0 - rlo : r1 - rlo, c0 - clo : c1 - clo] for (_, _, (r0, r1), (c0, c1)) in plan.recvs]
            )
            (a, b), (c, e) = plan.own
            r0, r1, c0, c1 = _own_part(plan, box_ranges)
            if (r0, r1, c0, c1) == (a, b, c, e):
                grad_x = grad_box[:, :, a - rlo : b - rlo, c - clo : e - clo]
            else:  # rows/columns of the tile no output window reads (strided kernels, uneven tiles): zero gradient
                grad_x = x.new_empty(x.shape)
                for sl in (
                    (slice(None), slice(None), slice(0, r0 - a)),
                    (slice(None), slice(None), slice(r1 - a, None)),
                    (slice(None), slice(None), slice(None), slice(0, c0 - c)),
                    (slice(None), slice(None), slice(None), slice(c1 - c, None)),
                ):
                    grad_x[sl].zero_()
                grad_x[:, :, r0 - a : r1 - a, c0 - c : c1 - c] = grad_box[
                    :, :, r0 - rlo : r1 - rlo, c0 - clo : c1 - clo
                ]
            del grad_box
            grad_x = ex.finish_backward(grad_x, inplace=True)
        return grad_x, grad_w if need_w else None, grad_b, None, None


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
        if self.pointwise:
            self._record(x, (plan.rows.n_out, plan.cols.n_out))
            return F.conv2d(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        if not self.kfac_record_input:  # (K-FAC capture steps need the padded box: the paths below build it)
            regions = self._edge_regions(h, w, plan)
            if regions is not None:
                return _TileConv2d.apply(x, weight, bias, self, plan, regions)
        if not self.overlap or weight is not self.weight:
            return _HaloConv2d.apply(x, weight, bias, self, plan)
        return self._forward_tiled(x, plan)

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
