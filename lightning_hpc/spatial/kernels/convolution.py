"""Convolution (:func:`conv`: ``F.conv1d`` / ``conv2d`` / ``conv3d``) of a tile split over 1, 2 or 3 spatial dimensions
(Dryden et al., section III-A, Eqs. 1-3; overlap per section IV-A).

Each rank computes the output entries of its (blocked) output tile.  It needs its input tile plus a halo of
exactly the entries its output windows reach (:func:`convolution_windows`, the one description of the halo the
plan, the acceptance check and the kernels share); the sample's border is zero padding (other padding modes
reach the kernel already padded by ``F.pad``).  Two paths, both equal to the serial op:

* the in-place tile path (:class:`_TileConv`, whenever every tile starts at a multiple of the stride and its
  output block is the native output of the tile): ONE native convolution of the tile itself, padded like the
  serial op, gives every output whose window stays in the tile; only the edge slabs whose windows read a
  neighbour's entries are recomputed from small boxes and written over it.  In ``k`` dimensions the edge
  regions are, recursively, the low and high slabs along the first split dimension over the full extent of the
  others, then those along the second within the middle, and so on (:func:`edge_regions`).  No copy of the tile
  in forward or backward.
* the box path (:class:`_BoxConv`): the tile is copied into one box with its halo and the border zeros while
  the halo travels, and one native convolution runs on the box.

Backward (autograd through the exchange): dL/dx of the halo goes back to its owner and is added into its tile;
dL/dw and dL/db are this tile's partial sums of Eq. 2, which the caller sums over the spatial group.

K-FAC: ``record(box, out_extents)`` (optional) receives the halo- and border-padded input box whose padding-0
convolution gives exactly this tile's outputs (its unfolded patches are this tile's share of KFC's expansion)
and the global output extents; a recorded call takes the box path, which builds that box anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.kernels.plan import autocast_cast, halo_plan, ntuple
from lightning_hpc.spatial.layout.halo_exchange import Halo, HaloExchange, HaloPlan, Window1d, intersect, trailing
from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import NotTraceable, Trace, refuse_trace

__all__ = [
    "conv",
    "ConvPlan",
    "plan_conv",
    "run_conv",
    "convolution_windows",
    "edge_regions",
    "tile_convolution_applies",
    "extended_box",
    "native_padding",
    "Recorder",
]

Range = tuple[int, int]
Region = tuple[Range, ...]  # global ranges, one per split dimension
#: ``record(padded_input_box, global_output_extents)``: the K-FAC hook of :func:`conv`
Recorder = Callable[[torch.Tensor, tuple[int, ...]], None]
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def convolution_windows(weight_shape: Sequence[int], stride: Any = 1, padding: Any = 0,
                        dilation: Any = 1) -> tuple[Window1d, ...]:
    """Per spatial dimension of a convolution with weight ``weight_shape`` (``C_out x C_in/groups x k_1 ...``),
    the input window of each output (torch's ``padding`` semantics: an int or one per dimension, ``'valid'`` or
    ``'same'``; with ``'same'`` and an even dilated kernel span torch pads ``span // 2`` before and the rest
    after, and allows stride 1 only)."""
    k = len(weight_shape) - 2
    if k not in (1, 2, 3):
        raise ValueError(f"convolution: weight of shape {tuple(weight_shape)} has {k} spatial dimensions, not 1-3")
    kernel = tuple(int(v) for v in weight_shape[2:])
    s, d = ntuple(stride, k, "stride"), ntuple(dilation, k, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            return tuple(Window1d(kk, ss, 0, dd) for kk, ss, dd in zip(kernel, s, d))
        if padding != "same":
            raise ValueError(f"convolution: padding={padding!r}; torch accepts 'valid', 'same' or ints")
        if any(v != 1 for v in s):
            raise ValueError("convolution: padding='same' is not supported for strided convolutions (as in torch)")
        out = []
        for kk, dd in zip(kernel, d):
            total = dd * (kk - 1)
            lo = total // 2
            out.append(Window1d(kk, 1, lo, dd, padding_hi=None if total - lo == lo else total - lo))
        return tuple(out)
    p = ntuple(padding, k, "padding")
    return tuple(Window1d(kk, ss, pp, dd) for kk, ss, pp, dd in zip(kernel, s, p, d))


@dataclass(frozen=True)
class _Spec:
    """The arguments of one convolution call, as the autograd functions need them."""

    windows: tuple[Window1d, ...]
    groups: int
    overlap: bool

    @property
    def stride(self) -> list[int]:
        return [w.stride for w in self.windows]

    @property
    def dilation(self) -> list[int]:
        return [w.dilation for w in self.windows]

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             padding: Sequence[int]) -> torch.Tensor:
        return _CONV[len(self.windows)](x, weight, bias, self.stride, list(padding), self.dilation, self.groups)

    def conv_backward(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: bool,
                      padding: Sequence[int], mask: Sequence[bool]) -> tuple[Any, Any, Any]:
        k = len(self.windows)
        return torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if bias else None, self.stride, list(padding), self.dilation, False,
            [0] * k, self.groups, list(mask))


@dataclass(frozen=True)
class ConvPlan:
    """Everything one convolution call decides from its layout and arguments alone (no tensor values): the
    windows, the halo plan, which path runs and the output extents.  A pure function of (grid position, global
    extents, weight shape, stride, padding, dilation, groups, overlap, path): made once per distinct call by
    :func:`plan_conv` and replayed by :func:`run_conv` (the op dispatch caches it per call site)."""

    spec: _Spec
    plan: HaloPlan
    #: the in-place tile path's edge regions, or None where only the box path applies
    regions: list | None
    pointwise: bool
    #: no tile of the grid exchanges anything and this tile's own native convolution is its output tile: the
    #: native op with its own autograd (the halo exchange's tag counter still advances, so every rank agrees)
    native: bool
    out_extents: tuple[int, ...]
    path: str
    #: the native convolution's stride, padding and dilation lists (made once: the ``native`` path's call)
    native_args: tuple[list[int], list[int], list[int]] = ((), (), ())  # type: ignore[assignment]


def plan_conv(grid: SpatialGrid, extents: Sequence[int], weight_shape: Sequence[int], stride: Any = 1,
              padding: Any = 0, dilation: Any = 1, groups: int = 1, *, path: str = "auto", overlap: bool = False,
              tile: torch.Tensor | None = None) -> ConvPlan:
    """The :class:`ConvPlan` of ``F.conv{k}d`` over a tile of ``grid`` (``tile`` checked against the plan's
    block when given)."""
    k = grid.ndim
    op = f"conv{k}d"
    if len(weight_shape) != k + 2:
        raise ValueError(f"{op}: weight of shape {tuple(weight_shape)} for a grid of {k} split dimensions")
    if path not in ("auto", "tile", "box"):
        raise ValueError(f"{op}: path={path!r}; expected 'auto', 'tile' or 'box'")
    windows = convolution_windows(weight_shape, stride, padding, dilation)
    plan = halo_plan(grid, extents, windows, op, tile=tile)
    spec = _Spec(tuple(windows), int(groups), bool(overlap))
    pointwise = all(w.kernel == 1 and w.stride == 1 and w.padding == 0 and w.symmetric for w in windows)
    regions = None
    if not pointwise and path != "box":
        key = ("edge_regions", tuple(windows))
        if key not in plan.memo:  # a pure function of the (cached) plan
            plan.memo[key] = edge_regions(plan, windows)
        regions = plan.memo[key]
        if regions is None and path == "tile":
            raise ValueError(f"{op}: the in-place tile path does not apply to tile {plan.index} (a tile starts "
                             f"off the stride grid or its output block is not the tile's own output)")
    exchange_free = all(o0 <= lo and hi <= o1 for d in plan.dims for (o0, o1), (lo, hi) in zip(d.owns,
                                                                                                d.needs_clamped))
    return ConvPlan(spec, plan, regions, pointwise, bool(exchange_free and regions == []),
                    tuple(dim.n_out for dim in plan.dims), path,
                    (spec.stride, [w.padding for w in windows], spec.dilation))


def run_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cp: ConvPlan,
             record: Recorder | None = None) -> torch.Tensor:
    """This rank's output tile of the convolution ``cp`` plans, on the tile ``x`` (see :func:`conv`)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):  # the dtype autocast casts a convolution's operands to
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return run_conv(autocast_cast(x, dtype), autocast_cast(weight, dtype),
                            None if bias is None else autocast_cast(bias, dtype), cp, record)
    spec, k = cp.spec, len(cp.spec.windows)
    if cp.pointwise:
        if record is not None:  # pointwise: the tile is its own box, no halo
            record(x.detach(), cp.out_extents)
        return spec.conv(x, weight, bias, [0] * k)
    if Trace.active and not (cp.native and record is None and cp.regions is not None):
        return _traced_conv(x, weight, bias, cp, record)
    if record is None and cp.regions is not None:
        if cp.native:
            cp.plan.grid.next_tag()  # as the exchange of any other path would: the ranks' tags stay in step
            stride, padding, dilation = cp.native_args
            return _CONV[k](x, weight, bias, stride, padding, dilation, spec.groups)
        return _TileConv.apply(x, weight, bias, spec, cp.plan, cp.regions)
    return _BoxConv.apply(x, weight, bias, spec, cp.plan, record)


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: SpatialGrid,
         extents: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
         path: str = "auto", overlap: bool = False, record: Recorder | None = None) -> torch.Tensor:
    """This rank's output tile of ``F.conv{k}d(x_global, weight, bias, stride, padding, dilation, groups)``.

    ``x``: this rank's tile (``N x C x ...``, its last ``grid.ndim`` dimensions split, blocked over
    ``grid.parts``); ``extents``: the global extents of the split dimensions.  Returns the output tile, blocked
    the same way over the output's global extents.  ``path``: ``'auto'`` (the in-place tile path where it
    applies, else the box), ``'tile'`` (an error where it does not apply) or ``'box'``; ``overlap``: the tile
    path waits for the halo after the tile's convolution (and, in backward, after its backward).  ``record``:
    the K-FAC hook (module docstring).  Under autocast the operands are cast as autocast casts a convolution's,
    so the result is the serial op's in the same dtype.  (:func:`plan_conv` + :func:`run_conv`.)"""
    return run_conv(x, weight, bias, plan_conv(grid, extents, weight.shape, stride, padding, dilation, groups,
                                               path=path, overlap=overlap, tile=x), record)


def native_padding(plan: HaloPlan, windows: Sequence[Window1d]) -> tuple[int, ...]:
    """Per split dimension, the zero padding the native convolution applies itself: along a dimension with one
    part the tile spans the sample, so the box spans it too and the convolution pads it exactly as the serial op
    does (no padding slabs to fill, whole-extent copies).  Only symmetric padding can be left to the op."""
    return tuple(w.padding if dim.parts == 1 and w.symmetric else 0 for w, dim in zip(windows, plan.dims))


def _box_ranges(plan: HaloPlan, native: Sequence[int]) -> tuple[Range, ...]:
    """Global range of the box along each split dimension: the needed range, or the whole extent along a
    dimension the convolution pads natively."""
    return tuple((0, dim.n) if p else need for need, p, dim in zip(plan.need, native, plan.dims))


def _own_part(plan: HaloPlan, box: Sequence[Range]) -> tuple[Range, ...]:
    """The part of this tile inside the box (a strided kernel may not read a tile's last entries)."""
    return tuple(intersect(own, b) for own, b in zip(plan.own, box))


def _rel(ranges: Sequence[Range], origin: Sequence[Range]) -> tuple[Any, ...]:
    """The index of global ``ranges`` in a buffer whose split dimensions start at ``origin``'s lower ends."""
    return trailing(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(ranges, origin))


def extended_box(x: torch.Tensor, blocks: list[torch.Tensor], plan: HaloPlan, out: torch.Tensor | None = None,
                 own: bool = True, native: Sequence[int] | None = None) -> torch.Tensor:
    """The input box of this tile in one buffer: the tile's entries it uses, the received halo blocks (in
    ``plan.recvs`` order) and zeros for the sample's border (except the ``native`` border the convolution pads
    itself).  Each element is written once (no zero-fill of the whole box, no concatenation).  ``own=False``
    leaves the tile's part to a later call (``out`` given: the buffer of the first)."""
    k = plan.ndim
    native = (0,) * k if native is None else tuple(native)
    box = _box_ranges(plan, native)
    if out is None:
        out = x.new_empty(*x.shape[: x.dim() - k], *(hi - lo for lo, hi in box))
        # the sample's border: zero padding, only the slabs outside the sample
        for e, ((lo, hi), (clo, chi)) in enumerate(zip(box, plan.need_clamped)):
            dim = out.dim() - k + e
            if clo > lo:
                out.narrow(dim, 0, min(clo, hi) - lo).zero_()
            if hi > chi:
                start = max(chi, lo) - lo
                out.narrow(dim, start, hi - lo - start).zero_()
    if own:
        part = _own_part(plan, box)
        if all(hi > lo for lo, hi in part):
            out[_rel(part, box)].copy_(x[plan.local(part)])
    for (_, _, *ranges), buf in zip(plan.recvs, blocks):
        out[_rel(ranges, box)].copy_(buf)
    return out


def _tile_outputs(win: Window1d, own: Range, out: Range, n: int) -> tuple[int, int, int, int] | None:
    """Along one dimension of extent ``n``: for a tile owning input ``[a, b)`` and output ``[oa, ob)``, the output
    ranges ``(oa, ia, ib, ob)`` whose ``[ia, ib)`` the tile's own convolution already gets right (see
    :func:`edge_regions`), or ``None`` when the tile cannot be convolved in place."""
    (a, b), (oa, ob) = own, out
    length = b - a
    if not win.symmetric or length + 2 * win.padding < win.span or a % win.stride:
        return None
    native = (length + 2 * win.padding - win.span) // win.stride + 1
    if oa != a // win.stride or ob - oa != native:
        return None
    first, stop = win.outputs_within(a, b)
    ia = oa if a == 0 else max(oa, first)
    ib = ob if b == n else min(ob, stop)
    return None if ib < ia else (oa, ia, ib, ob)


def edge_regions(plan: HaloPlan, windows: Sequence[Window1d]) -> list[tuple[Region, Region]] | None:
    """For the in-place tile path: the output regions of this tile whose windows read halo entries, each with its
    global input box, or ``None`` when the tile cannot be convolved in place.

    A native convolution of the tile alone with the op's own padding ``p`` computes, at local output ``j``, the
    window starting at global input ``a + j*s - p`` (``a`` the tile's first entry).  That is global output
    ``j + a/s`` exactly when ``s`` divides ``a``, and the tile's output block is then the native output if it
    starts at ``a/s`` and has the native count.  Every output whose window stays inside the tile (or reads only
    the border's zero padding, on a border tile) is then already right; the rest lie in slabs along the split
    edges: along dimension 0 the low and high slabs over the full extent of the other dimensions, then along
    dimension 1 within dimension 0's middle, and so on, so the regions do not overlap."""
    per_dim = [_tile_outputs(win, own, out, dim.n) for dim, win, own, out in zip(plan.dims, windows, plan.own,
                                                                                   plan.out)]
    if any(r is None for r in per_dim):
        return None
    k = plan.ndim
    regions: list[Region] = []
    middle: list[Range] = []
    for e, r in enumerate(per_dim):
        assert r is not None
        oa, ia, ib, ob = r
        rest = list(plan.out[e + 1 :])
        for lo, hi in ((oa, ia), (ib, ob)):
            if hi > lo:
                regions.append((*middle, (lo, hi), *rest))
        if ib <= ia:
            break  # no middle along this dimension: the slabs cover everything
        middle.append((ia, ib))
    dims = plan.dims
    return [(reg, tuple(windows[e].needed(o0, o1, dims[e].n) for e, (o0, o1) in enumerate(reg))) for reg in regions
            if len(reg) == k]


def tile_convolution_applies(extents: Sequence[int], parts: Sequence[int], windows: Sequence[Window1d]) -> bool:
    """Whether every tile of ``extents`` split ``parts`` (blocked) takes the in-place tile path, which copies no
    tile-size box (for a planner's cost of the halo box copies)."""
    for win, n, p in zip(windows, extents, parts):
        outs = block_bounds(win.out_size(n), p)
        if any(_tile_outputs(win, own, out, n) is None for own, out in zip(block_bounds(n, p), outs)):
            return False
    return True


def _traced_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cp: ConvPlan,
                 record: Recorder | None) -> torch.Tensor:
    """The convolution of :class:`_BoxConv` (the same box, the same native call) as a graph can hold it: the box
    is an operator with its own adjoint (``halo_box`` of :mod:`~lightning_hpc.spatial.kernels.graph_ops`)."""
    if record is not None:
        raise NotTraceable("a convolution whose input statistics K-FAC records on tiles")
    plan = cp.plan
    native = native_padding(plan, cp.spec.windows)
    if plan.grid.group is not None:
        box = torch.ops.lightning_hpc.halo_box(x, key_of(plan), [int(p) for p in native], 0.0)
    else:
        box = extended_box(x, [], plan, native=native)
    return cp.spec.conv(box, weight, bias, native)


def _grad_mask(ctx) -> tuple[bool, bool, bool]:
    """Which of (input, weight, bias) gradients a convolution node must produce."""
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]


def _flat(box: Sequence[Range]) -> list[int]:
    return [v for r in box for v in r]


class _TileConv(torch.autograd.Function):
    """Halo exchange + convolution without copying the tile (section III-A; overlap per section IV-A).

    Forward: ONE native convolution of the tile itself with the op's padding gives every output whose window
    stays inside the tile; the edge slabs whose windows reach into a neighbour's tile (:func:`edge_regions`) are
    recomputed from small boxes (tile edge + received halo + border zeros) and written over it.

    Backward, with ``B0`` an edge box as the tile convolution saw it (halo zeroed) and ``H = B - B0`` its halo
    part: ``y_edge = conv(B0) + conv(H)`` (linear), so the tile convolution's backward over the whole output
    gradient gives the tile's input gradient and the weight gradient for ``B0``; the edge boxes add
    ``dL/dw += conv_w_grad(g_edge, H)`` and the halo gradients ``conv_in_grad(g_edge, w)`` on ``H``'s halo
    entries, which go back to their owners (posted before the tile's backward, so they travel while it runs)
    and are added into the owners' edge entries."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: _Spec, plan: HaloPlan, regions):  # type: ignore[override]
        refuse_trace('a convolution on tiles (eager form)')
        exchange = HaloExchange(plan)
        exchange.post_forward(x)
        padding = [w.padding for w in spec.windows]
        blocks = None if spec.overlap else exchange.finish_forward()
        y = spec.conv(x, weight, bias, padding)
        if blocks is None:
            blocks = exchange.finish_forward()
        halo = Halo(x, blocks, plan)
        k = plan.ndim
        for region, box in regions:
            y[_rel(region, plan.out)] = spec.conv(halo.box(*_flat(box)), weight, bias, [0] * k)
        ctx.save_for_backward(x, weight, *blocks)
        ctx.exchange, ctx.plan, ctx.spec, ctx.regions, ctx.has_bias = exchange, plan, spec, regions, bias is not None
        return y

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, *blocks = ctx.saved_tensors
        plan, spec = ctx.plan, ctx.spec
        k = plan.ndim
        need_x, need_w, need_b = _grad_mask(ctx)
        halo = Halo(x, blocks, plan)
        halo_grads = [torch.zeros_like(b) for b in blocks] if need_x else []
        grad_w_edges = []
        for region, box in ctx.regions:
            g = grad_out[_rel(region, plan.out)]
            grad_box, grad_w, _ = spec.conv_backward(g, halo.box(*_flat(box), own_zero=True), weight, False, [0] * k,
                                                     [need_x, need_w, False])
            if need_w:
                grad_w_edges.append(grad_w)
            for (_, _, *ranges), hg in zip(plan.recvs, halo_grads):  # the box's part on each received block
                cut = [intersect(r, b) for r, b in zip(ranges, box)]
                if all(hi > lo for lo, hi in cut):
                    hg[_rel(cut, ranges)] += grad_box[_rel(cut, box)]
        ex = ctx.exchange
        if need_x:  # every rank of the group agrees (same op), so either all exchange or none does
            ex.post_backward(halo_grads)
            if not spec.overlap:
                ex.wait()
        grad_x, grad_w, grad_b = spec.conv_backward(grad_out, x, weight, ctx.has_bias,
                                                    [w.padding for w in spec.windows], [need_x, need_w, need_b])
        if need_w:
            for gw in grad_w_edges:
                grad_w += gw
        if need_x:
            grad_x = ex.finish_backward(grad_x, inplace=True)
        return grad_x, grad_w if need_w else None, grad_b, None, None, None


class _BoxConv(torch.autograd.Function):
    """Halo exchange + convolution of one tile as one autograd node (section III-A).

    Forward posts the halo messages, copies the tile into the extended box while they travel, adds the halos
    and the border zeros, and runs ONE native convolution (padding only along a dimension that is not split,
    where the box spans the sample).  Only the tile and the (small) halo blocks are saved; backward rebuilds the
    box, runs the native convolution backward, posts the halo gradients back to their owners and adds those
    received from the neighbours into the tile's edge entries (the adjoint of the forward exchange)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: _Spec, plan: HaloPlan, record):  # type: ignore[override]
        refuse_trace('a convolution on tiles (eager form)')
        native = native_padding(plan, spec.windows)
        exchange = HaloExchange(plan)
        exchange.post_forward(x)
        box = extended_box(x, [], plan, native=native)  # tile copied while the halos travel
        blocks = exchange.finish_forward()
        extended_box(x, blocks, plan, out=box, own=False, native=native)
        y = spec.conv(box, weight, bias, native)
        if record is not None:  # K-FAC's patches need the box with the native padding made explicit
            pads = [v for p in reversed(native) for v in (p, p)]
            record((F.pad(box, pads) if any(native) else box).detach(), tuple(dim.n_out for dim in plan.dims))
        ctx.save_for_backward(x, weight, *blocks)
        ctx.exchange, ctx.plan, ctx.spec, ctx.native, ctx.has_bias = exchange, plan, spec, native, bias is not None
        return y

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, *blocks = ctx.saved_tensors
        plan, spec, native = ctx.plan, ctx.spec, ctx.native
        need_x, need_w, need_b = _grad_mask(ctx)
        box = extended_box(x, blocks, plan, native=native)
        grad_box, grad_w, grad_b = spec.conv_backward(grad_out, box, weight, ctx.has_bias, native,
                                                      [need_x, need_w, need_b])
        del box
        grad_x = None
        if need_x:  # every rank of the group agrees (same op), so either all exchange or none does
            ranges = _box_ranges(plan, native)
            ex = ctx.exchange
            ex.post_backward([grad_box[_rel(r, ranges)] for (_, _, *r) in plan.recvs])
            part = _own_part(plan, ranges)
            if part == plan.own:
                grad_x = grad_box[_rel(part, ranges)]
            else:  # entries of the tile no output window reads (strided kernels, uneven tiles): zero gradient
                grad_x = x.new_zeros(x.shape)
                if all(hi > lo for lo, hi in part):
                    grad_x[plan.local(part)] = grad_box[_rel(part, ranges)]
            del grad_box
            grad_x = ex.finish_backward(grad_x, inplace=True)
        return grad_x, grad_w if need_w else None, grad_b, None, None, None
