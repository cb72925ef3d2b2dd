"""Shape ops that keep the split dimensions whole: ``cat``/``chunk``/``split``/``unbind`` and indexing over
unsplit dimensions, ``permute``/``transpose``, ``unsqueeze``; and slicing of split dimensions
(``x[..., a:b:s, c:d:t]``, ``narrow``: a centre crop, a strided subsample), whose kept rows are moved to the
blocked layout of the output's extent (:mod:`remap`).  Integer indices of split dimensions and views that merge
them go to the gather path.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hpc.spatial.dispatch.autograd import _tile_of
from lightning_hpc.spatial.dispatch.calls import _call_with, _norm_dim
from lightning_hpc.spatial.dispatch.elementwise import _align_operand
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.relayout import _remap_split
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like, _wrap_reduced, dims_with
from lightning_hpc.spatial.remap import blocked


# the signatures' parts the handlers read (the builtins have none; the sections argument of chunk/split/tensor_split
# has a different name in each op, the numpy-style aliases name dimensions ``axis``)
def _cat_args(tensors, dim=0, *, axis=None): ...  # noqa: E704
def _sectioned(input, sections=None, dim=0, **_): ...  # noqa: E704
def _unbind(input, dim=0): ...  # noqa: E704
def _permute_args(input, *given, dims=None): ...  # noqa: E704  (x.permute(0, 2, 1) or one sequence, or dims=)
def _transpose_args(input, dim0, dim1): ...  # noqa: E704
def _swapaxes_args(input, axis0, axis1): ...  # noqa: E704
def _unsqueeze_args(input, dim): ...  # noqa: E704
def _narrow_args(input, dim, start, length): ...  # noqa: E704
def _getitem_args(input, index): ...  # noqa: E704
def _setitem_args(input, index, value): ...  # noqa: E704


@_handles(*_resolve("cat concat concatenate"), signature=_cat_args)
def _cat(func, a, args, kwargs):
    tensors = list(a["tensors"])
    spatial = [t for t in tensors if isinstance(t, SpatialTensor)]
    if not spatial:
        return NotImplemented  # (split only in an ``out=``, which does not bind)
    ref = spatial[0]
    dim = _norm_dim(a["dim"] if a["axis"] is None else a["axis"], ref.dim())
    if dim in ref._sdims:
        return NotImplemented
    extents = [ref._gshape[d] for d in ref._sdims]
    locs = []
    for t in tensors:
        if isinstance(t, SpatialTensor):
            if t._grid is not ref._grid or t._sdims != ref._sdims or t.dim() != ref.dim() or \
                    [t._gshape[d] for d in t._sdims] != extents:
                return NotImplemented
            locs.append(_plain(t))
        else:
            if t.dim() != ref.dim():
                return NotImplemented
            kind = _align_operand(t, ref.dim(), ref, ref._sdims)
            if kind != "full" and not (kind == "broadcast" and not ref.split_dims):
                if kind == "broadcast" and [t.shape[d] for d in ref._sdims] == extents:
                    kind = "full"
                else:
                    return NotImplemented
            locs.append(_tile_of(t, ref._grid, ref._sdims))
    out = torch.cat(locs, dim)
    gshape = list(ref._gshape)
    gshape[dim] = out.shape[dim]
    return _wrap_like(out, ref, gshape)


@_handles(*_resolve("unbind"), signature=_unbind)
@_handles(*_resolve("chunk split tensor_split"), signature=_sectioned)
def _chunk(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    dim = _norm_dim(a["dim"], x.dim())
    if dim in x._sdims:
        return NotImplemented
    parts = _call_with(func, args, kwargs, x, _plain(x))  # the other arguments as given
    if func.__name__ == "unbind":
        return tuple(_wrap_reduced(p, x, [dim], False) for p in parts)
    g = list(x._gshape)
    return tuple(_wrap_like(p, x, g[:dim] + [p.shape[dim]] + g[dim + 1:]) for p in parts)


def _permuted(x: SpatialTensor, dims) -> SpatialTensor:
    dims = [_norm_dim(d, x.dim()) for d in dims]
    out = _plain(x).permute(dims)
    return _wrap_like(out, x, [x._gshape[d] for d in dims], tuple(dims.index(d) for d in x._sdims))


@_handles(torch.Tensor.permute, torch.permute, signature=_permute_args)
def _permute(func, a, args, kwargs):
    x, given, dims = a["input"], a["given"], a["dims"]
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = given[0]
    if not isinstance(x, SpatialTensor) or (dims is None) == (not given):
        return NotImplemented  # no dims, or given twice: the serial op's error
    return _permuted(x, given if dims is None else dims)


@_handles(*_resolve("swapaxes"), signature=_swapaxes_args)
@_handles(*_resolve("transpose swapdims"), signature=_transpose_args)
def _transpose(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    d0, d1 = (_norm_dim(d, x.dim()) for d in ((a["dim0"], a["dim1"]) if "dim0" in a else (a["axis0"], a["axis1"])))
    perm = list(range(x.dim()))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(x, perm)


@_handles(*_resolve("unsqueeze"), signature=_unsqueeze_args)
def _unsqueeze(func, a, args, kwargs):
    x = a["input"]
    d = a["dim"] % (x.dim() + 1)
    g = list(x._gshape)
    g.insert(d, 1)
    return _wrap_like(_plain(x).unsqueeze(d), x, g, dims_with(x._sdims, d))


@_handles(torch.narrow, torch.Tensor.narrow, signature=_narrow_args)
def _narrow(func, a, args, kwargs):
    """``narrow(dim, start, length)``: the slice ``start:start + length`` of ``dim`` (:func:`_getitem`)."""
    x, dim, start, length = a["input"], a["dim"], a["start"], a["length"]
    if not isinstance(x, SpatialTensor) or not all(isinstance(v, int) for v in (dim, start, length)):
        return NotImplemented
    dim = _norm_dim(dim, x.dim())
    if start < 0:
        start += x._gshape[dim]  # as narrow counts a negative start
    if not (0 <= start and length >= 0 and start + length <= x._gshape[dim]):
        return NotImplemented  # the serial op's error, from the gather path
    return _getitem(func, {"input": x, "index": (slice(None),) * dim + (slice(start, start + length),)}, args, kwargs)


@_handles(torch.Tensor.__getitem__, signature=_getitem_args)
def _getitem(func, a, args, kwargs):
    x, idx = a["input"], a["index"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return NotImplemented
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1:
        return NotImplemented
    if Ellipsis not in items:
        items = (*items, Ellipsis)  # the dimensions not indexed are whole
    e = items.index(Ellipsis)
    expanded: list[Any] = [*items[:e], *[slice(None)] * (x.dim() - n_real), *items[e + 1:]]
    src, out_dim, g = 0, 0, []
    new_sdims: list[int | None] = [None] * len(x._sdims)
    split = x.split_dims
    maps: list = [None] * len(x._sdims)  # per grid axis: the rows a slice of a split dimension keeps (a remap)
    for k, i in enumerate(expanded):
        if i is None:
            g.append(1)
            out_dim += 1
            continue
        if isinstance(i, int):
            if src in x._sdims:
                return NotImplemented  # drops a split dimension: gathered
        else:
            kept = range(*i.indices(x._gshape[src]))
            if src in split and i != slice(None):
                axis = x._sdims.index(src)
                parts = x._grid.parts[axis]
                if len(kept) < parts:
                    return NotImplemented  # fewer rows than tiles: gathered
                maps[axis] = (blocked(x._gshape[src], parts), blocked(len(kept), parts), kept)
                expanded[k] = slice(None)  # the tile keeps all its rows; the remap picks and re-blocks them
            if src in x._sdims:
                new_sdims[x._sdims.index(src)] = out_dim
            g.append(len(kept))
            out_dim += 1
        src += 1
    out = _plain(x)[tuple(expanded)]
    sdims = tuple(d for d in new_sdims if d is not None)
    if any(m is not None for m in maps):
        out = _remap_split(x, out, maps, dims=sdims)
    return _wrap_like(out, x, g, sdims)


@_handles(torch.Tensor.__setitem__, signature=_setitem_args)
def _setitem(func, a, args, kwargs):
    """``x[mask] = value`` with a boolean mask of ``x``'s dimensions (split like it, or whole: cut to the tile) and
    one value: ``x.masked_fill_(mask, value)``, element-wise on the tile.  Any other assignment into a split
    activation goes to the gather path, which refuses in-place edits."""
    x, idx, value = a["input"], a["index"], a["value"]
    if not isinstance(x, SpatialTensor) or not isinstance(idx, torch.Tensor) or idx.dtype != torch.bool \
            or idx.dim() != x.dim():
        return NotImplemented
    if isinstance(value, torch.Tensor):
        if isinstance(value, SpatialTensor) or value.dim() != 0:
            return NotImplemented
    elif not isinstance(value, (bool, int, float)):
        return NotImplemented
    x.masked_fill_(idx, value)
    return None
