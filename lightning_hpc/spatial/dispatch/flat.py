"""Views that merge split dimensions: ``x.view(N, C, -1)``, ``x.flatten(2)``, ``x.reshape(N, -1)`` of a split
activation, as Dice losses write them (``(N, C, H, W) -> (N, C, H*W)``, then sums over the merged dimension).

The tile of such a view is the tile's own view: its elements are this tile's positions of the merged dimensions
in row-major order, which are not a block of the merged dimension (a tile of ``H x W`` is not a range of
``H*W``).  :class:`FlatSpatialTensor` records that layout: per dimension, the row-major list of the *atoms* it
flattens, each an extent and the grid axis that blocks it (``-1``: whole on every rank).  An ordinary split
tensor is the case of one atom per dimension, and a view that brings every dimension back to one atom (the view
back to ``(N, C, H, W)``) is an ordinary :class:`SpatialTensor` again.

On this layout, computed on the tile: element-wise ops between tensors whose dimensions hold the same atoms
(plain operands broadcast along the merged dimensions or spanning only whole ones), ``sum``/``mean``/``nansum``
over dimensions that hold every divided atom (summed over the spatial group: one process's value) or over whole
dimensions only, further views, ``permute``/``transpose``, ``unsqueeze``/``squeeze``, ``softmax`` over whole
dimensions, ``F.one_hot``, ``*_like`` and conversions.  Anything else on it is computed on the gathered whole
tensor exactly as one process does (the gather path's warning and counters), and a result of the view's shape
is cut back to its layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc._compat import disable_torch_function_subclass
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _tile_of
from lightning_hpc.spatial.dispatch.calls import _flat, _inplace_call, _is_inplace, _norm_dim
from lightning_hpc.spatial.dispatch.fallback import gathered_call
from lightning_hpc.spatial.dispatch.registry import (
    _ELEMENTWISE,
    _HANDLERS,
    _META,
    _NO_TENSOR_OUT,
    _handles,
    _resolve,
    run_registered,
)
from lightning_hpc.spatial.dispatch.registry import _torch_function as _split_torch_function
from lightning_hpc.spatial.dispatch.state import _STATE, SpatialDispatchError
from lightning_hpc.spatial.dispatch.state import where as where_of
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _alias, _plain, _spatials, _Trace
from lightning_hpc.spatial.layout.collectives import all_reduce_replicated
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import refuse_trace

#: one flattened dimension: its extent and the grid axis blocking it (-1: whole on every rank)
Atom = tuple[int, int]
Atoms = tuple[tuple[Atom, ...], ...]


class FlatSpatialTensor(SpatialTensor):
    """A view of a split activation that merges split dimensions (see the module docstring): ``_atoms[d]`` lists
    what dimension ``d`` flattens, row-major; the tile holds this rank's part of each atom, flattened the same
    way.  ``_sdims[k]``: the dimension holding grid axis ``k``'s atom."""

    _atoms: Atoms

    def full(self) -> torch.Tensor:
        """The whole tensor on every rank: the tile viewed atom by atom is an ordinary tile, gathered, then
        viewed as this tensor (differentiable)."""
        shape, sdims, local = _expanded(self._grid, self._atoms)
        tile = SpatialTensor.wrap(_plain(self).reshape(local), self._grid, shape, sdims)
        return tile.full().reshape(self._gshape)

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The dimensions holding an atom divided among ranks."""
        return tuple(d for d, dim in enumerate(self._atoms) if any(_divided(self._grid, a) for a in dim))

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return (f"FlatSpatialTensor(global shape {tuple(self._gshape)}, atoms {self._atoms} over "
                f"{self._grid.parts}, tile={_plain(self)!r})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _STATE.depth += 1
        try:
            return _dispatch_flat(func, args, kwargs)
        finally:
            _STATE.depth -= 1


def _divided(grid: SpatialGrid, atom: Atom) -> bool:
    return atom[1] >= 0 and grid.parts[atom[1]] > 1


def _local_extent(grid: SpatialGrid, atom: Atom) -> int:
    n, k = atom
    if k < 0:
        return n
    a, b = block_bounds(n, grid.parts[k])[grid.index[k]]
    return b - a


def _expanded(grid: SpatialGrid, atoms: Atoms) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The tensor with one dimension per atom: its global shape, split dimensions and tile shape."""
    flat = [a for dim in atoms for a in dim]
    sdims = tuple(next(i for i, (_, k) in enumerate(flat) if k == axis) for axis in range(grid.ndim))
    return tuple(n for n, _ in flat), sdims, tuple(_local_extent(grid, a) for a in flat)


def atoms_of(t: SpatialTensor) -> Atoms:
    """The atoms of a split tensor (one per dimension for an ordinary one)."""
    if isinstance(t, FlatSpatialTensor):
        return t._atoms
    axis = {d: k for k, d in enumerate(t._sdims)}
    return tuple(((n, axis.get(d, -1)),) for d, n in enumerate(t._gshape))


def _normal(atoms: Sequence[Sequence[Atom]]) -> Atoms:
    """Atoms in their one form: whole atoms next to each other joined, whole atoms of extent 1 dropped from
    dimensions that hold others."""
    out = []
    for dim in atoms:
        kept: list[Atom] = []
        for n, k in dim:
            if k < 0 and n == 1 and len(dim) > 1:
                continue
            if k < 0 and kept and kept[-1][1] < 0:
                kept[-1] = (kept[-1][0] * n, -1)
            else:
                kept.append((n, k))
        out.append(tuple(kept) or ((1, -1),))
    return tuple(out)


def make(local: torch.Tensor, grid: SpatialGrid, atoms: Sequence[Sequence[Atom]]) -> SpatialTensor:
    """Wrap ``local``, this rank's tile of a tensor laid out as ``atoms``: an ordinary :class:`SpatialTensor`
    where every dimension is one atom, else a :class:`FlatSpatialTensor`."""
    norm = _normal(atoms)
    gshape = tuple(math.prod(n for n, _ in dim) for dim in norm)
    if tuple(local.shape) != tuple(math.prod(_local_extent(grid, a) for a in dim) for dim in norm):
        raise SpatialDispatchError(f"spatial: internal error: a tile of shape {tuple(local.shape)} for the layout "
                                   f"{norm} in {where_of(grid)}")
    if all(len(dim) == 1 for dim in norm):
        where = {dim[0][1]: d for d, dim in enumerate(norm) if dim[0][1] >= 0}
        return SpatialTensor.wrap(local, grid, gshape, tuple(where[k] for k in range(grid.ndim)), fresh=True)
    t: FlatSpatialTensor
    if type(local) is torch.Tensor:
        local.__class__ = FlatSpatialTensor
        t = local  # type: ignore[assignment]
    elif _Trace.active:
        t = _alias(local)  # type: ignore[assignment]
        t.__class__ = FlatSpatialTensor
    else:
        with disable_torch_function_subclass():
            t = local.as_subclass(FlatSpatialTensor)  # type: ignore[assignment]
    t._grid, t._gshape, t._atoms = grid, gshape, norm
    t._sdims = tuple(next(d for d, dim in enumerate(norm) if any(k == axis for _, k in dim))
                     for axis in range(grid.ndim))
    return t


# ---- views ---------------------------------------------------------------------------------------------------


def _regroup(grid: SpatialGrid, atoms: Atoms, shape: Sequence[int]) -> list[list[Atom]] | None:
    """The atoms of ``shape``, a view of a tensor laid out as ``atoms``: each dimension of the view takes the
    next atoms in row-major order; a whole atom may be divided between dimensions, an atom blocked over the grid
    may not (None: no tiled form)."""
    queue = [a for dim in atoms for a in dim]
    out: list[list[Atom]] = []
    i = 0
    for size in shape:
        group: list[Atom] = []
        prod = 1
        while prod < size:
            if i == len(queue):
                return None
            n, k = queue[i]
            if size % (prod * n) == 0:
                group.append((n, k))
                prod *= n
                i += 1
            elif k < 0 and size % prod == 0 and n % (size // prod) == 0:
                need = size // prod
                group.append((need, -1))
                queue[i] = (n // need, -1)
                prod = size
            else:
                return None
        out.append(group)
    rest = queue[i:]
    if any(n != 1 for n, _ in rest):
        return None
    if rest:  # atoms of extent 1 left over (a grid axis of one part): kept in the last dimension
        if not out:
            return None
        out[-1].extend(rest)
    return out


def _view_shape(x: SpatialTensor, shape: Sequence[Any]) -> list[int] | None:
    """``shape`` as the view reads it (one ``-1`` inferred from the global size), or None."""
    if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
        shape = shape[0]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape) or sum(s == -1 for s in shape) > 1:
        return None
    numel = math.prod(x._gshape)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or numel % known:
            return None
        shape = [numel // known if s == -1 else s for s in shape]
    return list(shape) if math.prod(shape) == numel and min(shape, default=0) >= 0 else None


def _viewed(x: SpatialTensor, shape: Sequence[Any]):
    target = _view_shape(x, shape)
    if target is None:
        return NotImplemented  # (the serial op's error, or a dtype view: gathered)
    groups = _regroup(x._grid, atoms_of(x), target)
    if groups is None:
        return NotImplemented
    local = [math.prod(_local_extent(x._grid, a) for a in g) for g in groups]
    # reshape, not view, on the tile: a tile taken by a layout change may not be viewable where the whole is
    return make(_plain(x).reshape(local), x._grid, groups)


def _view_args(input, *shape, size=None): ...  # noqa: E704  (x.view(2, -1), x.view((2, -1)), x.view(size=...))
def _reshape_args(input, *given, shape=None): ...  # noqa: E704
def _as_args(input, other): ...  # noqa: E704
def _flatten_args(input, start_dim=0, end_dim=-1): ...  # noqa: E704
def _unflatten_args(input, dim, sizes): ...  # noqa: E704


@_handles(torch.Tensor.view, signature=_view_args)
def _view(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor) or (a["size"] is None) == (not a["shape"]):
        return NotImplemented
    return _viewed(x, a["shape"] if a["size"] is None else (a["size"],))


@_handles(torch.reshape, torch.Tensor.reshape, signature=_reshape_args)
def _reshape(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor) or (a["shape"] is None) == (not a["given"]):
        return NotImplemented
    return _viewed(x, a["given"] if a["shape"] is None else (a["shape"],))


@_handles(torch.Tensor.view_as, torch.Tensor.reshape_as, signature=_as_args)
def _view_as(func, a, args, kwargs):
    x, other = a["input"], a["other"]
    if not isinstance(x, SpatialTensor) or not isinstance(other, torch.Tensor):
        return NotImplemented
    return _viewed(x, (tuple(other.shape),))


@_handles(torch.flatten, torch.Tensor.flatten, signature=_flatten_args)
def _flatten(func, a, args, kwargs):
    x, s, e = a["input"], a["start_dim"], a["end_dim"]
    if not isinstance(x, SpatialTensor) or not isinstance(s, int) or not isinstance(e, int):
        return NotImplemented  # (named dimensions: gathered)
    g = list(x._gshape)
    if not g:
        return NotImplemented
    s, e = _norm_dim(s, len(g)), _norm_dim(e, len(g))
    if s > e:
        return NotImplemented
    return _viewed(x, (g[:s] + [math.prod(g[s:e + 1])] + g[e + 1:],))


@_handles(torch.unflatten, torch.Tensor.unflatten, signature=_unflatten_args)
def _unflatten(func, a, args, kwargs):
    x, dim, sizes = a["input"], a["dim"], a["sizes"]
    if not isinstance(x, SpatialTensor) or not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
        return NotImplemented
    g = list(x._gshape)
    d = _norm_dim(dim, len(g))
    sizes = list(sizes)
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        if known == 0 or g[d] % known:
            return NotImplemented
        sizes = [g[d] // known if s == -1 else s for s in sizes]
    return _viewed(x, (g[:d] + sizes + g[d + 1:],))


# ---- the merged layout's own ops -----------------------------------------------------------------------------

_FLAT_HANDLERS: dict[Any, tuple[Callable, Callable | None]] = {}


def _flat_handles(*funcs, signature: Callable | None = None):
    """Register a handler for ops with a :class:`FlatSpatialTensor` operand (as :func:`registry._handles`)."""
    def deco(fn):
        for f in funcs:
            _FLAT_HANDLERS[f] = (fn, signature)
        return fn
    return deco


# the views above take either layout
for _f in (torch.Tensor.view, torch.reshape, torch.Tensor.reshape, torch.Tensor.view_as, torch.Tensor.reshape_as,
           torch.flatten, torch.Tensor.flatten, torch.unflatten, torch.Tensor.unflatten):
    _FLAT_HANDLERS[_f] = _HANDLERS[_f]


def _reduce_args(input, dim=None, keepdim=False, *, dtype=None, axis=None): ...  # noqa: E704
def _permute_args(input, *given, dims=None): ...  # noqa: E704
def _transpose_args(input, dim0, dim1): ...  # noqa: E704
def _dim_args(input, dim=None): ...  # noqa: E704
def _softmax_args(input, dim=None, *_, **__): ...  # noqa: E704
def _like_args(input, *_, **__): ...  # noqa: E704


@_flat_handles(*_resolve("sum mean nansum"), signature=_reduce_args)
def _flat_reduce(func, a, args, kwargs):
    x, keepdim, dtype = a["input"], a["keepdim"], a["dtype"]
    dim = a["dim"] if a["axis"] is None else a["axis"]
    if not isinstance(x, FlatSpatialTensor):
        return NotImplemented
    every = dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0)
    dims = list(range(x.dim())) if every else \
        [_norm_dim(d, x.dim()) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    split = set(x.split_dims)
    local = _plain(x)
    if split <= set(dims):  # every divided atom reduced: summed over the group (one process's value)
        summed = (torch.nansum if func.__name__ == "nansum" else torch.sum)(
            local, dim=dims, keepdim=keepdim, dtype=dtype)
        total = all_reduce_replicated(summed, x._grid.group)
        if func.__name__ == "mean":
            total = total / math.prod(x._gshape[d] for d in dims)
        return total
    if split & set(dims) or any(k >= 0 for d in dims for _, k in x._atoms[d]):
        return NotImplemented  # partly over the divided atoms, or over a grid axis of one part: gathered
    out = func(local, dim=dims, keepdim=keepdim, dtype=dtype)
    atoms = [((1, -1),) if d in dims else at for d, at in enumerate(x._atoms) if keepdim or d not in dims]
    return make(out, x._grid, atoms)


@_flat_handles(torch.Tensor.permute, torch.permute, signature=_permute_args)
def _flat_permute(func, a, args, kwargs):
    x, given, dims = a["input"], a["given"], a["dims"]
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = given[0]
    if not isinstance(x, FlatSpatialTensor) or (dims is None) == (not given):
        return NotImplemented
    order = [_norm_dim(d, x.dim()) for d in (given if dims is None else dims)]
    return make(_plain(x).permute(order), x._grid, [x._atoms[d] for d in order])


@_flat_handles(*_resolve("transpose swapdims"), signature=_transpose_args)
def _flat_transpose(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, FlatSpatialTensor):
        return NotImplemented
    order = list(range(x.dim()))
    d0, d1 = _norm_dim(a["dim0"], x.dim()), _norm_dim(a["dim1"], x.dim())
    order[d0], order[d1] = order[d1], order[d0]
    return make(_plain(x).permute(order), x._grid, [x._atoms[d] for d in order])


@_flat_handles(*_resolve("unsqueeze"), signature=_dim_args)
def _flat_unsqueeze(func, a, args, kwargs):
    x, d = a["input"], a["dim"]
    if not isinstance(x, FlatSpatialTensor) or not isinstance(d, int):
        return NotImplemented
    d = d % (x.dim() + 1)
    atoms = list(x._atoms)
    atoms.insert(d, ((1, -1),))
    return make(_plain(x).unsqueeze(d), x._grid, atoms)


@_flat_handles(*_resolve("squeeze"), signature=_dim_args)
def _flat_squeeze(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, FlatSpatialTensor):
        return NotImplemented
    dims = squeezed_dims(x, a["dim"])
    if dims is None or any(k >= 0 for d in dims for _, k in x._atoms[d]):
        return NotImplemented
    return make(_plain(x).squeeze(tuple(dims)), x._grid, [at for d, at in enumerate(x._atoms) if d not in dims])


def squeezed_dims(x: SpatialTensor, dim) -> list[int] | None:
    """The dimensions ``squeeze(dim)`` drops from ``x`` (those of global size 1 among the given ones, or all)."""
    if dim is None:
        given = list(range(x.dim()))
    elif isinstance(dim, int):
        given = [dim]
    elif isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        given = list(dim)
    else:
        return None
    return sorted({_norm_dim(d, x.dim()) for d in given if x._gshape[d] == 1}) if x.dim() else None


@_flat_handles(*_resolve("softmax log_softmax"), signature=_softmax_args)
def _flat_softmax(func, a, args, kwargs):
    x, dim = a["input"], a["dim"]
    if not isinstance(x, FlatSpatialTensor) or not isinstance(dim, int) or \
            any(k >= 0 for _, k in x._atoms[_norm_dim(dim, x.dim())]):
        return NotImplemented
    return make(_with_tiles(func, args, kwargs), x._grid, x._atoms)


@_flat_handles(*_resolve("zeros_like ones_like empty_like full_like rand_like randn_like randint_like"),
               signature=_like_args)
def _flat_like(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, FlatSpatialTensor) or func.__name__.startswith("rand"):
        return NotImplemented  # random values: drawn for the whole tensor, as one process draws them (gathered)
    return make(_with_tiles(func, args, kwargs), x._grid, x._atoms)


def _with_tiles(func, args, kwargs):
    """``func`` called as given with every split operand's tile in its place."""
    def tile(v):
        return _plain(v) if isinstance(v, SpatialTensor) else v
    return func(*(tile(v) for v in args), **{k: tile(v) for k, v in kwargs.items()})


def _one_hot_args(input, num_classes=-1): ...  # noqa: E704


@_flat_handles(torch.nn.functional.one_hot, signature=_one_hot_args)
@_handles(torch.nn.functional.one_hot, signature=_one_hot_args)
def _one_hot(func, a, args, kwargs):
    """``F.one_hot`` of a split label: per position, so on the tile; the class dimension appended is whole.
    ``num_classes=-1`` (the largest label + 1) takes the largest label over the group."""
    x, classes = a["input"], a["num_classes"]
    if not isinstance(x, SpatialTensor) or not isinstance(classes, int) or x.dtype != torch.int64:
        return NotImplemented  # (the serial op's error)
    local = _plain(x)
    if classes < 0:
        if local.numel() == 0:
            return NotImplemented
        refuse_trace("F.one_hot(num_classes=-1) of a split label (the largest label read back to the host)")
        top = local.max().reshape(1)
        if x._grid.group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=x._grid.group)
        classes = int(top.item()) + 1
    return make(func(local, classes), x._grid, (*atoms_of(x), ((classes, -1),)))


_CONVERSIONS = {torch.Tensor.type_as, torch.Tensor.to}


def _flat_elementwise(func, args, kwargs):
    """An element-wise op with a merged-layout operand: every split operand must hold the same atoms along
    each dimension it does not broadcast; a plain operand may span only whole atoms."""
    spatial = _spatials(args, kwargs)
    grid = spatial[0]._grid
    if any(t._grid is not grid for t in spatial):
        return NotImplemented
    if func in _CONVERSIONS and isinstance(args[0], SpatialTensor):  # another tensor gives only dtype and device
        return make(_with_tiles(func, args, kwargs), grid, atoms_of(args[0]))
    tensors = [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]
    ndim = max(t.dim() for t in tensors)
    out: list[tuple[Atom, ...] | None] = [None] * ndim
    for t in (t for t in tensors if isinstance(t, SpatialTensor)):
        for d, at in enumerate(atoms_of(t), ndim - t.dim()):
            if math.prod(n for n, _ in at) == 1 and not any(k >= 0 for _, k in at):
                continue  # broadcast
            if out[d] is not None and out[d] != at:
                return NotImplemented  # laid out differently: gathered
            out[d] = at
    for t in (t for t in tensors if not isinstance(t, SpatialTensor)):
        for d, n in enumerate(t.shape, ndim - t.dim()):
            at = out[d]
            if n == 1:
                continue
            if at is None:
                out[d] = ((n, -1),)
            elif math.prod(m for m, _ in at) != n or any(_divided(grid, a) for a in at):
                return NotImplemented  # spans divided atoms (not cut in the merged order): gathered
    atoms = [at or ((1, -1),) for at in out]

    def local(v):
        if isinstance(v, SpatialTensor):
            return _plain(v)
        if isinstance(v, torch.Tensor):
            return _replicated_operand(v, grid)
        if isinstance(v, (list, tuple)) and any(isinstance(u, torch.Tensor) for u in v):
            return type(v)(local(u) for u in v)
        return v

    largs, lkw = [local(v) for v in args], {k: local(v) for k, v in kwargs.items()}
    if _is_inplace(func) or _inplace_call(kwargs):
        if not isinstance(args[0], FlatSpatialTensor) or [a for a in atoms] != list(args[0]._atoms):
            return NotImplemented  # a plain tensor updated from tiles, or one that would grow: gathered
        with disable_torch_function_subclass():
            func(args[0], *largs[1:], **lkw)
        return args[0]
    return make(func(*largs, **lkw), grid, atoms)


def _property(func, args, kwargs):
    owner = getattr(func, "__self__", None)
    name = getattr(owner, "__name__", "")
    t = args[0]
    if name == "shape":
        return torch.Size(t._gshape)
    if name in ("T", "mT", "H", "mH", "real", "imag"):
        return _gather(func, args, kwargs)
    with disable_torch_function_subclass():
        out = func(*args, **kwargs)
    if name in ("data", "grad") and isinstance(out, torch.Tensor) and not isinstance(out, SpatialTensor):
        return make(out.view_as(out), t._grid, t._atoms)
    return out


_LAYOUT_FREE = set(_resolve("size numel __len__ __format__")) | _META | _NO_TENSOR_OUT


def _dispatch_flat(func, args, kwargs):
    entry = _FLAT_HANDLERS.get(func)
    if entry is not None:
        out = run_registered(entry, func, args, kwargs)
        if out is not NotImplemented:
            return out
    elif getattr(func, "__name__", None) == "__get__":
        return _property(func, args, kwargs)
    elif func in _LAYOUT_FREE:  # sizes (global), metadata, hooks, backward: the ordinary split tensor's handling
        return _split_torch_function(SpatialTensor, func, (), args, kwargs)
    elif func in _ELEMENTWISE:
        out = _flat_elementwise(func, args, kwargs)
        if out is not NotImplemented:
            return out
    return _gather(func, args, kwargs)


def _gather(func, args, kwargs):
    """The gather path for an op with a merged-layout operand (as :func:`fallback._fallback`): the split
    operands gathered, the op computed on the whole tensors, a result of the first merged operand's shape cut
    back to its layout."""
    spatial = _spatials(args, kwargs)
    out = gathered_call(func, args, kwargs, spatial, what="a view merging split dimensions",
                        reason="has no tiled form on a view merging split dimensions",
                        inplace_fix="Write it out of place, or apply it before the view",
                        fix="To avoid the gather, apply it before the view (see docs/spatial.md), or pass "
                            "on_unsupported='error' to see every such op")
    return _recut(out, next(t for t in spatial if isinstance(t, FlatSpatialTensor)))


def _recut(out, ref: FlatSpatialTensor):
    if isinstance(out, torch.Tensor) and not isinstance(out, SpatialTensor):
        if tuple(out.shape) != tuple(ref._gshape) or not (out.is_floating_point() or not out.requires_grad):
            return out
        shape, sdims, local = _expanded(ref._grid, ref._atoms)
        tile = _tile_of(out.reshape(shape), ref._grid, sdims)
        return make(tile.reshape(tuple(math.prod(_local_extent(ref._grid, a) for a in dim) for dim in ref._atoms)),
                    ref._grid, ref._atoms)
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_recut(o, ref) for o in out)
    return out
