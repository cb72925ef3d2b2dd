"""Tiled kernels of the convolution and pooling calls: ``F.conv2d`` (halo exchange, :mod:`conv`),
``F.conv_transpose2d`` (halo exchange, :mod:`convtranspose`), ``F.max_pool2d``/``F.avg_pool2d`` incl.
``ceil_mode`` (:mod:`pooling`), ``F.interpolate`` nearest/bilinear (:mod:`upsample`), and
``F.adaptive_avg_pool2d``/``F.adaptive_max_pool2d`` (window sums / maxima over the group, replicated result).
Calls a kernel cannot do exactly are declined (the gather path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand
from lightning_hpc.spatial.dispatch.calls import _arg, _tuple2
from lightning_hpc.spatial.dispatch.reductions import _reduce
from lightning_hpc.spatial.dispatch.registry import _handles
from lightning_hpc.spatial.dispatch.state import _STATE, SpatialDispatchError
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _nchw, _plain, _wrap_like
from lightning_hpc.spatial.halo_exchange import PartitionError
from lightning_hpc.spatial.tiling import SpatialGrid

_KERNELS: dict[tuple, Any] = {}


def _cached(key: tuple, make):
    kern = _KERNELS.get(key)
    if kern is None:
        if len(_KERNELS) > 512:
            _KERNELS.clear()
        kern = _KERNELS[key] = make()
    return kern


def _conv_kernel(grid_id: int, grid: SpatialGrid, k, stride, padding, dilation, groups, cin, cout):
    from lightning_hpc.spatial.conv import SpatialConv2d

    def make():
        meta = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=False, device="meta")
        return SpatialConv2d.from_module(meta, grid, overlap=False, name="F.conv2d")

    return _cached(("conv", grid_id, k, stride, padding, dilation, groups, cin, cout), make)


def _partition_error(e: PartitionError, op: str) -> SpatialDispatchError:
    return SpatialDispatchError(f"spatial: {op} in {_STATE.where()}: {e}")


@_handles(F.conv2d, torch.conv2d)
def _conv2d(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    weight = _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    stride, padding, dilation, groups = (_arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 4, "padding", 0),
                                         _arg(args, kwargs, 5, "dilation", 1), _arg(args, kwargs, 6, "groups", 1))
    if isinstance(x, SpatialTensor) and x.dim() == 4 and x._sdims == (3, 2) and \
            isinstance(weight, torch.Tensor) and not isinstance(weight, SpatialTensor) and weight.dim() == 4:
        # split along W, H (after a transpose(2, 3)): the convolution of the transposed input with the transposed
        # kernel, transposed back, is the same convolution, and that one is tiled
        def swap(v: Any) -> Any:
            return v if isinstance(v, str) else _tuple2(v)[::-1]

        out = F.conv2d(x.transpose(2, 3), weight.transpose(2, 3), bias, swap(stride), swap(padding), swap(dilation),
                       groups)
        return out.transpose(2, 3)
    if not _nchw(x) or isinstance(weight, SpatialTensor):
        return NotImplemented
    if padding == "same" and isinstance(weight, torch.Tensor) and weight.dim() == 4:
        # as torch pads for "same": d * (k - 1) in all, the odd one at the end; an even kernel span is asymmetric,
        # which the halo plan's symmetric padding cannot express, so that padding is a (tiled) F.pad first
        lo_hi = [(s // 2, s - s // 2) for s in (d * (k - 1) for d, k in zip(_tuple2(dilation), weight.shape[-2:]))]
        if any(lo != hi for lo, hi in lo_hi):
            x = F.pad(x, (lo_hi[1][0], lo_hi[1][1], lo_hi[0][0], lo_hi[0][1]))
            padding = 0
        else:
            padding = (lo_hi[0][0], lo_hi[1][0])
    c = x._gshape[1]
    if weight.dim() != 4 or weight.shape[1] * groups != c:
        raise SpatialDispatchError(
            f"spatial: F.conv2d in {_STATE.where()}: the input has {c} channels but the weight {tuple(weight.shape)} "
            f"with groups={groups} expects {weight.shape[1] * groups}; fix the layer's in_channels"
        )
    pad = padding if isinstance(padding, str) else _tuple2(padding)
    try:
        kern = _conv_kernel(id(x._grid), x._grid, tuple(weight.shape[-2:]), _tuple2(stride), pad, _tuple2(dilation),
                            int(groups), int(c), int(weight.shape[0]))
    except ValueError as e:
        raise SpatialDispatchError(f"spatial: F.conv2d in {_STATE.where()}: {e}") from None
    h, w = x._gshape[2], x._gshape[3]
    try:
        plan = kern.halo_plan(h, w)
    except PartitionError as e:
        raise _partition_error(e, "F.conv2d") from None
    weight = _replicated_operand(weight, x._grid)
    bias = _replicated_operand(bias, x._grid) if bias is not None else None
    out = kern.tile_forward(_plain(x), weight, bias, h, w)
    return _wrap_like(out, x, (x._gshape[0], weight.shape[0], plan.rows.n_out, plan.cols.n_out))


@_handles(torch.conv_transpose2d)
def _conv_transpose2d(func, args, kwargs):
    """Halo exchange of the input rows each output tile reads, then the local kernel (:mod:`convtranspose`)."""
    from lightning_hpc.spatial.convtranspose import TransposedWindow1d, tile_conv_transpose2d, transposed_plan

    x = args[0] if args else kwargs["input"]
    weight = _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    if not _nchw(x) or isinstance(weight, SpatialTensor) or isinstance(bias, SpatialTensor) or weight.dim() != 4:
        return NotImplemented
    stride, padding = _tuple2(_arg(args, kwargs, 3, "stride", 1)), _tuple2(_arg(args, kwargs, 4, "padding", 0))
    out_pad = _tuple2(_arg(args, kwargs, 5, "output_padding", 0))
    groups, dilation = int(_arg(args, kwargs, 6, "groups", 1)), _tuple2(_arg(args, kwargs, 7, "dilation", 1))
    if x._gshape[1] != weight.shape[0]:
        return NotImplemented  # the serial op's error, from the gathered call
    wh, ww = (TransposedWindow1d(int(weight.shape[2 + k]), int(stride[k]), int(padding[k]), int(dilation[k]),
                                 int(out_pad[k]))
              for k in (0, 1))
    if not (wh.exact_on_tiles and ww.exact_on_tiles):
        return NotImplemented  # stride larger than the kernel's span: gathered
    h, w = x._gshape[2], x._gshape[3]
    try:
        plan = _cached(("convT", id(x._grid), h, w, wh, ww), lambda: transposed_plan(x._grid, h, w, wh, ww))
    except PartitionError:
        return NotImplemented  # a tile smaller than its halo: gathered (exact)
    weight = _replicated_operand(weight, x._grid)
    bias = _replicated_operand(bias, x._grid) if bias is not None else None
    out = tile_conv_transpose2d(_plain(x), weight, bias, plan, wh, ww, groups)
    return _wrap_like(out, x, (x._gshape[0], weight.shape[1] * groups, plan.rows.n_out, plan.cols.n_out))


def _pool_kernel(grid_id: int, grid: SpatialGrid, kind: str, k, s, p, d, count_include_pad, ceil_mode):
    from lightning_hpc.spatial.pooling import SpatialAvgPool2d, SpatialMaxPool2d

    def make():
        if kind == "max":
            pool = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil_mode)
            return SpatialMaxPool2d.from_module(pool, grid, name="F.max_pool2d")
        pool = nn.AvgPool2d(k, s, p, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
        return SpatialAvgPool2d.from_module(pool, grid, name="F.avg_pool2d")

    return _cached(("pool", grid_id, kind, k, s, p, d, count_include_pad, ceil_mode), make)


@_handles(F.max_pool2d, torch.max_pool2d, getattr(F, "_max_pool2d", None))
def _max_pool(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    k = _arg(args, kwargs, 1, "kernel_size")
    s = _arg(args, kwargs, 2, "stride", None) or k
    p, d = _arg(args, kwargs, 3, "padding", 0), _arg(args, kwargs, 4, "dilation", 1)
    if _arg(args, kwargs, 6, "return_indices", False):
        return NotImplemented
    ceil = bool(_arg(args, kwargs, 5, "ceil_mode", False))
    if _whole_window(x, k, p, d):
        return F.adaptive_max_pool2d(x, 1)
    kern = _pool_kernel(id(x._grid), x._grid, "max", _tuple2(k), _tuple2(s), _tuple2(p), _tuple2(d), True, ceil)
    return _run_layer(kern, x, "F.max_pool2d")


@_handles(F.avg_pool2d, torch._C._nn.avg_pool2d)
def _avg_pool(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    k = _arg(args, kwargs, 1, "kernel_size")
    s = _arg(args, kwargs, 2, "stride", None) or k
    p = _arg(args, kwargs, 3, "padding", 0)
    if _arg(args, kwargs, 6, "divisor_override", None) is not None:
        return NotImplemented
    cip, ceil = _arg(args, kwargs, 5, "count_include_pad", True), bool(_arg(args, kwargs, 4, "ceil_mode", False))
    if _whole_window(x, k, p, 1):
        return F.adaptive_avg_pool2d(x, 1)
    kern = _pool_kernel(id(x._grid), x._grid, "avg", _tuple2(k), _tuple2(s), _tuple2(p), (1, 1), bool(cip), ceil)
    return _run_layer(kern, x, "F.avg_pool2d")


def _whole_window(x: SpatialTensor, k: Any, p: Any, d: Any) -> bool:
    """A pooling window that is the whole H x W (``F.avg_pool2d(x, x.shape[2:])``): one output per channel, the
    global pooling, whose tiled form is the adaptive pooling to 1 (a tile is smaller than such a window, so the
    halo plan has none)."""
    return _tuple2(k) == (x._gshape[2], x._gshape[3]) and _tuple2(p) == (0, 0) and _tuple2(d) == (1, 1)


def _run_layer(layer, x: SpatialTensor, op: str):
    """A spatial layer's tile forward with the known global extent; output wrapped with its global extent."""
    h, w = x._gshape[2], x._gshape[3]
    try:
        layer.halo_plan(h, w)
        out = layer.tile_call(_plain(x), (h, w))
    except PartitionError as e:
        raise _partition_error(e, op) from None
    wh, ww = layer.windows(h, w)
    return _wrap_like(out, x, (x._gshape[0], out.shape[1], wh.out_size(h), ww.out_size(w)))


@_handles(F.interpolate)
def _interpolate(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    size, sf = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor")
    mode, ac = _arg(args, kwargs, 3, "mode", "nearest"), _arg(args, kwargs, 4, "align_corners")
    rsf, aa = _arg(args, kwargs, 5, "recompute_scale_factor"), _arg(args, kwargs, 6, "antialias", False)
    if mode not in ("nearest", "bilinear") or rsf or aa:
        return NotImplemented
    from lightning_hpc.spatial.upsample import SpatialUpsample

    up = nn.Upsample(size=size, scale_factor=sf, mode=mode, align_corners=ac)
    kern = SpatialUpsample.from_module(up, x._grid, name="F.interpolate")
    return _run_layer(kern, x, "F.interpolate")


@_handles(F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d)
def _adaptive_avg(func, args, kwargs):
    """Size 1: the global mean.  Size ``(kh, kw)``: each window's partial sum on each tile, summed over the
    spatial group (:func:`pooling.adaptive_avg_pool_tile`); the result is replicated, like the global mean."""
    x = args[0] if args else kwargs["input"]
    if _nchw(x) and _arg(args, kwargs, 1, "output_size") in (1, (1, 1), [1, 1]):
        return _reduce(torch.mean, (x, (2, 3), True), {})
    from lightning_hpc.spatial.pooling import adaptive_avg_pool_tile

    call = _adaptive_call(args, kwargs)
    return NotImplemented if call is None else adaptive_avg_pool_tile(*call)


def _adaptive_call(args, kwargs):
    """``(tile, group, (H, W), tile origin, (kh, kw))`` of an adaptive pooling of a split N x C x H x W input, or
    None (an output size of None, keep the input's extent, or an invalid one: gathered, the serial op's error)."""
    x = args[0] if args else kwargs["input"]
    kh, kw = _tuple2(_arg(args, kwargs, 1, "output_size"))
    if not _nchw(x) or not all(isinstance(k, int) and k > 0 for k in (kh, kw)):
        return None
    h, w = x._gshape[2], x._gshape[3]
    (h0, _), (w0, _) = x._grid.tile_bounds(h, w)
    return _plain(x), x._grid.group, (h, w), (h0, w0), (kh, kw)


@_handles(F.adaptive_max_pool2d, F.adaptive_max_pool2d_with_indices, getattr(F, "_adaptive_max_pool2d", None))
def _adaptive_max(func, args, kwargs):
    """Each window's maximum over the spatial group, with the serial op's indices (the first maximum in row-major
    order); replicated like the average (:func:`pooling.adaptive_max_pool_tile`)."""
    from lightning_hpc.spatial.pooling import adaptive_max_pool_tile

    call = _adaptive_call(args, kwargs)
    if call is None:
        return NotImplemented
    out, idx = adaptive_max_pool_tile(*call)
    with_indices = func is F.adaptive_max_pool2d_with_indices or _arg(args, kwargs, 2, "return_indices", False)
    return (out, idx) if with_indices else out
