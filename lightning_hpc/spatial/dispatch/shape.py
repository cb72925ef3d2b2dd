"""Shape ops that keep the split dimensions whole: ``cat``/``chunk``/``split``/``unbind`` and indexing over
unsplit dimensions, ``permute``/``transpose``, ``unsqueeze``; and slicing of split dimensions
(``x[..., a:b:s, c:d:t]``, ``narrow``: a centre crop, a strided subsample), whose kept rows are moved to the
blocked layout of the output's extent (:mod:`remap`).  Integer indices of split dimensions and views that merge
them go to the gather path.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hpc.spatial.dispatch.autograd import _ScatterTile, _tile_index
from lightning_hpc.spatial.dispatch.calls import _norm_dim, bind_call
from lightning_hpc.spatial.dispatch.elementwise import _align_operand
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.relayout import _remap_split
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like, dims_with, dims_without
from lightning_hpc.spatial.remap import blocked


@_handles(*_resolve("cat concat concatenate"))
def _cat(func, args, kwargs):
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    spatial = [t for t in tensors if isinstance(t, SpatialTensor)]
    ref = spatial[0]
    dim = _norm_dim(dim, ref.dim())
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
            if t.requires_grad and ref._grid.group is not None:
                locs.append(_ScatterTile.apply(t, ref._grid, ref._sdims))
            else:
                locs.append(t[_tile_index(t.shape, ref._sdims, ref._grid)])
    out = torch.cat(locs, dim)
    gshape = list(ref._gshape)
    gshape[dim] = out.shape[dim]
    return _wrap_like(out, ref, gshape)


# the signatures' parts the handlers read (the sections argument has a different name in each op)
def _sectioned(input, sections=None, dim=0, **_): ...  # noqa: E704
def _unbind(input, dim=0): ...  # noqa: E704
def _narrow_args(input, dim, start, length): ...  # noqa: E704


@_handles(*_resolve("chunk split tensor_split unbind"))
def _chunk(func, args, kwargs):
    name = func.__name__
    a = bind_call(_unbind if name == "unbind" else _sectioned, args, kwargs)
    if a is None or not args or args[0] is not a["input"] or not isinstance(args[0], SpatialTensor):
        return NotImplemented  # (the op is rerun below on the tile with the other arguments as given)
    x = a["input"]
    dim = _norm_dim(a["dim"], x.dim())
    if dim in x._sdims:
        return NotImplemented
    parts = func(_plain(x), *args[1:], **kwargs)
    out = []
    for p in parts:
        if name == "unbind":
            g = list(x._gshape)
            del g[dim]
            out.append(_wrap_like(p, x, g, dims_without(x._sdims, [dim])))
        else:
            g = list(x._gshape)
            g[dim] = p.shape[dim]
            out.append(_wrap_like(p, x, g))
    return tuple(out)


@_handles(torch.Tensor.permute, torch.permute)
def _permute(func, args, kwargs):
    x = args[0]
    dims = args[1:] if len(args) > 1 else kwargs["dims"]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = [_norm_dim(d, x.dim()) for d in dims]
    out = _plain(x).permute(dims)
    return _wrap_like(out, x, [x._gshape[d] for d in dims], tuple(dims.index(d) for d in x._sdims))


@_handles(*_resolve("transpose swapaxes swapdims"))
def _transpose(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    d0, d1 = (_norm_dim(d, x.dim()) for d in args[1:3])
    perm = list(range(x.dim()))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(func, (x, perm), {})


@_handles(*_resolve("unsqueeze"))
def _unsqueeze(func, args, kwargs):
    x = args[0]
    d = args[1] if len(args) > 1 else kwargs["dim"]
    d = d % (x.dim() + 1)
    g = list(x._gshape)
    g.insert(d, 1)
    return _wrap_like(_plain(x).unsqueeze(d), x, g, dims_with(x._sdims, d))


@_handles(torch.narrow, torch.Tensor.narrow)
def _narrow(func, args, kwargs):
    """``narrow(dim, start, length)``: the slice ``start:start + length`` of ``dim`` (:func:`_getitem`)."""
    a = bind_call(_narrow_args, args, kwargs)
    if a is None:
        return NotImplemented
    x, dim, start, length = a["input"], a["dim"], a["start"], a["length"]
    if not isinstance(x, SpatialTensor) or not all(isinstance(v, int) for v in (dim, start, length)):
        return NotImplemented
    dim = _norm_dim(dim, x.dim())
    if start < 0:
        start += x._gshape[dim]  # as narrow counts a negative start
    if not (0 <= start and length >= 0 and start + length <= x._gshape[dim]):
        return NotImplemented  # the serial op's error, from the gather path
    return _getitem(func, (x, (slice(None),) * dim + (slice(start, start + length),)), {})


@_handles(torch.Tensor.__getitem__)
def _getitem(func, args, kwargs):
    x, idx = args[0], args[1]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return NotImplemented
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1:
        return NotImplemented
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - n_real))
        else:
            expanded.append(i)
    while sum(1 for i in expanded if i is not None) < x.dim():
        expanded.append(slice(None))
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


@_handles(torch.Tensor.__setitem__)
def _setitem(func, args, kwargs):
    """``x[mask] = value`` with a boolean mask of ``x``'s dimensions (split like it, or whole: cut to the tile) and
    one value: ``x.masked_fill_(mask, value)``, element-wise on the tile.  Any other assignment into a split
    activation goes to the gather path, which refuses in-place edits."""
    x, idx, value = args[0], args[1], args[2]
    if not isinstance(x, SpatialTensor) or kwargs or not isinstance(idx, torch.Tensor) or idx.dtype != torch.bool \
            or idx.dim() != x.dim():
        return NotImplemented
    if isinstance(value, torch.Tensor):
        if isinstance(value, SpatialTensor) or value.dim() != 0:
            return NotImplemented
    elif not isinstance(value, (bool, int, float)):
        return NotImplemented
    x.masked_fill_(idx, value)
    return None
