"""Ops that move rows between tiles (:mod:`remap`): ``F.pad`` of H and W in every mode (constant padding and
cropping by negative padding of any dimension, reflect/replicate/circular of H and W), slicing of the split
dimensions (:mod:`.shape`) and ``F.pixel_shuffle``/``F.pixel_unshuffle``, the output blocked over its own extent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.registry import _handles
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _channels_first, _plain, _wrap_like
from lightning_hpc.spatial.layout.remap import PAD_MODES, blocked, remap


def _remap_split(x: SpatialTensor, local: torch.Tensor, maps, dims: Sequence[int] | None = None,
                 fill: float = 0.0) -> torch.Tensor:
    """:func:`remap.remap` of the tile ``local`` along each grid axis in turn: ``maps`` holds per grid axis
    ``(in_bounds, out_bounds, src)`` or None (that dimension stays as it is); ``dims``: the tensor dimensions of
    the axes in ``local`` (default: those of ``x``); ``fill``: the value of outputs without a source."""
    for axis, m in enumerate(maps):
        if m is not None:
            in_bounds, out_bounds, src = m
            dim = x._sdims[axis] if dims is None else dims[axis]
            local = remap(local, x._grid, axis, dim, in_bounds, out_bounds, src, fill=fill)
    return local


def _pad_constant(x: SpatialTensor, pad: Sequence[int], value: float | None):
    """Constant ``F.pad`` (negative amounts crop) of any dimensions: the unsplit ones padded on the tile, each
    split one by a remap whose leading pad rows land on the first tiles and trailing ones on the last
    (:func:`remap.constant_pad_source`).  An output with fewer rows than tiles is gathered."""
    from lightning_hpc.spatial.layout.remap import (
        constant_pad_source,  # (looked up per call: a substitute takes effect)
    )

    if len(pad) % 2 or len(pad) > 2 * x.dim():
        return NotImplemented  # the serial op's error, from the gather path
    fill = 0.0 if value is None else value
    local_pad: list[int] = []
    maps: list = [None] * len(x._sdims)
    gshape = list(x._gshape)
    for k in range(len(pad) // 2):
        dim, lo, hi = x.dim() - 1 - k, int(pad[2 * k]), int(pad[2 * k + 1])
        n = gshape[dim]
        if dim in x.split_dims:
            axis = x._sdims.index(dim)
            parts = x._grid.parts[axis]
            if n + lo + hi < parts:
                return NotImplemented  # fewer rows than tiles (or the serial op's error): gathered
            if lo or hi:
                maps[axis] = (blocked(n, parts), blocked(n + lo + hi, parts), constant_pad_source(n, lo, hi))
            local_pad += [0, 0]
        else:
            local_pad += [lo, hi]
        gshape[dim] = n + lo + hi
    local = _plain(x)
    if any(local_pad):
        local = F.pad(local, local_pad, value=fill)
    return _wrap_like(_remap_split(x, local, maps, fill=fill), x, gshape)


def _constant_pad_nd_args(input, pad, value=0): ...  # noqa: E704  (torch.constant_pad_nd's signature)


@_handles(torch.constant_pad_nd, signature=_constant_pad_nd_args)
def _constant_pad_nd(func, a, args, kwargs):
    """``torch.constant_pad_nd``: :func:`_pad_constant`."""
    return _pad_constant(a["input"], a["pad"], a["value"])


@_handles(F.pad, torch._C._nn.pad, signature=F.pad)  # (torch._C._nn.pad has the same parameters)
def _pad(func, a, args, kwargs):
    """``F.pad``: constant padding (``nn.ZeroPad2d``, ``nn.ConstantPad3d``; negative amounts crop) of any
    dimensions (:func:`_pad_constant`), and mode reflect / replicate / circular of the spatial dimensions (the
    padding of ``nn.Conv1d/2d/3d`` with those ``padding_mode``s): rows moved and mirrored between tiles
    (:mod:`remap`), the output blocked over the padded extent.  Other modes and dimensions are gathered."""
    from lightning_hpc.spatial.layout.remap import pad_source  # (looked up per call: a substitute takes effect)

    x, pad, mode = a["input"], a["pad"], a["mode"]
    if isinstance(x, SpatialTensor) and mode == "constant":
        return _pad_constant(x, pad, a["value"])
    if not _channels_first(x) or mode not in PAD_MODES or len(pad) % 2 or not 0 < len(pad) // 2 <= x._grid.ndim:
        return NotImplemented  # (a non-constant padding pads the last len(pad) // 2 dimensions, all spatial here)
    k = x._grid.ndim
    maps: list = [None] * k
    gshape = list(x._gshape)
    for j in range(len(pad) // 2):  # F.pad's pairs run from the last dimension backwards
        axis, lo, hi = k - 1 - j, int(pad[2 * j]), int(pad[2 * j + 1])
        n = x._gshape[2 + axis]
        src = pad_source(n, lo, hi, mode)
        if src is None or n + lo + hi < x._grid.parts[axis]:
            return NotImplemented  # a padding F.pad refuses, or fewer rows than parts: gathered
        parts = x._grid.parts[axis]
        maps[axis] = (blocked(n, parts), blocked(len(src), parts), src) if lo or hi else None
        gshape[2 + axis] = len(src)
    return _wrap_like(_remap_split(x, _plain(x), maps), x, gshape)


def _pixel_shuffle_args(input, upscale_factor): ...  # noqa: E704  (torch's signatures)
def _pixel_unshuffle_args(input, downscale_factor): ...  # noqa: E704


@_handles(torch.pixel_shuffle, signature=_pixel_shuffle_args)
def _pixel_shuffle(func, a, args, kwargs):
    """Local on each tile (its rows become ``r`` times as many), then re-blocked over the ``r``-times extent."""
    x, r = a["input"], int(a["upscale_factor"])
    if not _channels_first(x, 2) or x._gshape[1] % (r * r):
        return NotImplemented
    local = torch.pixel_shuffle(_plain(x), r)
    maps = [(blocked(n, p, r), blocked(n * r, p), range(n * r)) for n, p in zip(x._gshape[2:], x._grid.parts)]
    gshape = (x._gshape[0], x._gshape[1] // (r * r), x._gshape[2] * r, x._gshape[3] * r)
    return _wrap_like(_remap_split(x, local, maps), x, gshape)


@_handles(torch.pixel_unshuffle, signature=_pixel_unshuffle_args)
def _pixel_unshuffle(func, a, args, kwargs):
    """Re-blocked so every tile holds ``r`` times the rows of its output tile (:mod:`remap`), then local."""
    x, r = a["input"], int(a["downscale_factor"])
    if not _channels_first(x, 2) or any(n % r or n // r < p for n, p in zip(x._gshape[2:], x._grid.parts)):
        return NotImplemented  # an extent not divisible by r (the serial error) or fewer output rows than parts
    maps = [(blocked(n, p), blocked(n // r, p, r), range(n)) for n, p in zip(x._gshape[2:], x._grid.parts)]
    local = _remap_split(x, _plain(x), maps)
    gshape = (x._gshape[0], x._gshape[1] * r * r, x._gshape[2] // r, x._gshape[3] // r)
    return _wrap_like(torch.pixel_unshuffle(local, r), x, gshape)
