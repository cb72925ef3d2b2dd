"""Shape ops that keep the split dimensions whole: ``cat``/``stack``/``chunk``/``split``/``unbind`` and indexing
over unsplit dimensions, ``permute``/``transpose``, ``unsqueeze``/``squeeze``, ``scatter``/``scatter_`` along an
unsplit dimension (a one-hot label); and slicing of split dimensions
(``x[..., a:b:s, c:d:t]``, ``narrow``: a centre crop, a strided subsample), whose kept rows are moved to the
blocked layout of the output's extent (:mod:`remap`).  Integer indices of split dimensions go to the gather
path; views that merge them are :mod:`.flat`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hpc._compat import disable_torch_function_subclass, storage_use_count
from lightning_hpc.spatial.dispatch.autograd import _tile_index, _tile_of
from lightning_hpc.spatial.dispatch.calls import _call_with, _norm_dim
from lightning_hpc.spatial.dispatch.elementwise import _align_operand
from lightning_hpc.spatial.dispatch.flat import squeezed_dims
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.relayout import _remap_split
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like, _wrap_reduced, dims_with
from lightning_hpc.spatial.layout.remap import blocked


# the signatures' parts the handlers read (the builtins have none; the sections argument of chunk/split/tensor_split
# has a different name in each op, the numpy-style aliases name dimensions ``axis``)
def _cat_args(tensors, dim=0, *, axis=None): ...  # noqa: E704
def _stack_args(tensors, dim=0): ...  # noqa: E704
def _squeeze_args(input, dim=None): ...  # noqa: E704
def _scatter_args(input, dim, index, src=None, value=None, *, reduce=None): ...  # noqa: E704
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
    locs = _aligned_tiles(tensors, ref)
    if locs is None:
        return NotImplemented
    out = torch.cat(locs, dim)
    gshape = list(ref._gshape)
    gshape[dim] = out.shape[dim]
    return _wrap_like(out, ref, gshape)


def _aligned_tiles(tensors, ref: SpatialTensor) -> list[torch.Tensor] | None:
    """The tiles of operands joined along an unsplit dimension: split ones laid out as ``ref``, plain ones
    spanning its split extents (cut to this tile) or, on one tile, broadcast; None for anything else."""
    extents = [ref._gshape[d] for d in ref._sdims]
    locs = []
    for t in tensors:
        if isinstance(t, SpatialTensor):
            if t._grid is not ref._grid or t._sdims != ref._sdims or t.dim() != ref.dim() or \
                    [t._gshape[d] for d in t._sdims] != extents:
                return None
            locs.append(_plain(t))
        else:
            if t.dim() != ref.dim():
                return None
            kind = _align_operand(t, ref.dim(), ref, ref._sdims)
            if kind != "full" and not (kind == "broadcast" and not ref.split_dims):
                if kind == "broadcast" and [t.shape[d] for d in ref._sdims] == extents:
                    kind = "full"
                else:
                    return None
            locs.append(_tile_of(t, ref._grid, ref._sdims))
    return locs


@_handles(torch.stack, signature=_stack_args)
def _stack(func, a, args, kwargs):
    """``torch.stack`` of split tensors laid out alike (a decoder merging its pyramid, ``torch.stack(fs).sum(0)``):
    the new dimension is never split, so the tiles are stacked; the split dimensions after it move by one."""
    tensors = list(a["tensors"])
    spatial = [t for t in tensors if isinstance(t, SpatialTensor)]
    if not spatial:
        return NotImplemented
    ref = spatial[0]
    if any(t.dim() != ref.dim() or tuple(t.shape) != tuple(ref._gshape) for t in tensors):
        return NotImplemented  # (the serial op's error)
    locs = _aligned_tiles(tensors, ref)
    if locs is None:
        return NotImplemented
    dim = _norm_dim(a["dim"], ref.dim() + 1)
    g = list(ref._gshape)
    g.insert(dim, len(tensors))
    return _wrap_like(torch.stack(locs, dim), ref, g, dims_with(ref._sdims, dim))


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


@_handles(*_resolve("squeeze"), signature=_squeeze_args)
def _squeeze(func, a, args, kwargs):
    """``squeeze`` of dimensions that are not laid out over the grid (a label's channel, ``y.squeeze(1)``)."""
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    dims = squeezed_dims(x, a["dim"])
    if dims is None or set(dims) & set(x._sdims):
        return NotImplemented  # (a grid axis of one part over a dimension of size 1: gathered)
    return _wrap_reduced(_plain(x).squeeze(tuple(dims)), x, dims, False)


@_handles(*_resolve("scatter scatter_ scatter_add scatter_add_"), signature=_scatter_args)
def _scatter(func, a, args, kwargs):
    """``scatter``/``scatter_``/``scatter_add`` along a dimension that is not split, with an index (and a source)
    split like the output: per position, so on the tiles.  A one-hot label written as MONAI writes it,
    ``torch.zeros(N, C, *spatial).scatter_(1, label, 1)``, scatters into a plain zeros tensor of the whole
    sample: its tile is taken, and the in-place form turns that tensor itself into the split result (its
    storage set to the tile), so it equals one process's afterwards without holding the whole sample."""
    x, dim, index, src = a["input"], a["dim"], a["index"], a["src"]
    if not isinstance(index, SpatialTensor) or not isinstance(dim, int) or a["value"] is not None and \
            isinstance(a["value"], torch.Tensor):
        return NotImplemented
    dim = _norm_dim(dim, index.dim())
    ref = index
    if isinstance(x, SpatialTensor):
        if x._grid is not ref._grid or x._sdims != ref._sdims or x.dim() != ref.dim() or \
                [x._gshape[d] for d in x._sdims] != [ref._gshape[d] for d in ref._sdims]:
            return NotImplemented
    elif not isinstance(x, torch.Tensor) or x.dim() != ref.dim() or \
            [x.shape[d] for d in ref._sdims] != [ref._gshape[d] for d in ref._sdims]:
        return NotImplemented
    if dim in ref._sdims:
        return NotImplemented
    if isinstance(src, torch.Tensor):
        src_tile = _aligned_tiles([src], ref)
        if src_tile is None or tuple(src.shape) != tuple(ref._gshape):
            return NotImplemented
    inplace = func.__name__.endswith("_")
    if inplace and not isinstance(x, SpatialTensor) and (
            x.requires_grad or x._base is not None
            or _storage_users(x) != _storage_users(torch.zeros(1))):
        # a plain tensor changed in place becomes the split result: only where nothing else sees it (no view of
        # it, no graph), else the whole sample is gathered and written as one process writes it
        return NotImplemented
    tiles = {id(index): _plain(index)}
    if isinstance(src, torch.Tensor):
        tiles[id(src)] = src_tile[0]
    if isinstance(x, SpatialTensor):
        tiles[id(x)] = _plain(x)
    else:  # this tile of the plain tensor (a copy for the in-place form: the whole one is replaced, not written)
        tiles[id(x)] = x[_tile_index(x.shape, ref._sdims, ref._grid)].clone() if inplace else \
            _tile_of(x, ref._grid, ref._sdims)
    largs = [tiles.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in args]
    lkw = {k: tiles.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if inplace and isinstance(x, SpatialTensor):
        with disable_torch_function_subclass():  # on the split tensor itself, not on an alias of it
            func(x, *largs[1:], **lkw)
        return x
    out = func(*largs, **lkw)
    gshape = tuple(x._gshape) if isinstance(x, SpatialTensor) else tuple(x.shape)
    if not inplace:
        return _wrap_like(out, ref, gshape)
    x.set_(out)
    return SpatialTensor.wrap(x, ref._grid, gshape, ref._sdims, fresh=True)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``t``'s storage: a tensor alone reads as a fresh one does."""
    return storage_use_count(t)


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
