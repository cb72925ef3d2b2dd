"""Element-wise ops on tiles, with broadcasting: a plain operand that is size 1 (or absent) along the split
dimensions is used as it is, one that spans the whole split extent is cut to this tile; anything else, or
split operands laid out differently, goes to the gather path.
"""

from __future__ import annotations

import torch

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _tile_of
from lightning_hpc.spatial.dispatch.calls import _flat, _inplace_call, _is_inplace, _op_name, bind_call
from lightning_hpc.spatial.dispatch.state import SpatialDispatchError, where
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _spatials, _Trace


def _align_operand(t, out_ndim: int, ref: SpatialTensor, sdims: tuple[int, ...]):
    """A plain operand of an element-wise op whose output is split along ``sdims``: ``"broadcast"`` (size 1 or
    absent along every split dim), ``"full"`` (spans the whole split extents: cut to this tile) or ``None``
    (anything else)."""
    off = out_ndim - t.dim()
    sizes = [1 if d - off < 0 else t.shape[d - off] for d in sdims]
    extents = [ref._gshape[d] for d in ref._sdims]
    if all(n == 1 or p == 1 and n == g for n, g, p in zip(sizes, extents, ref._grid.parts)):
        return "broadcast"
    if sizes == extents and all(d - off >= 0 for d in sdims):
        return "full"
    return None


def _localize(args, kwargs, spatial: list[SpatialTensor]):
    """Local operands for an op whose output is laid out like the broadcast of its operands, or None."""
    ref = spatial[0]
    tensors = [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]
    out_ndim = max(t.dim() for t in tensors)
    sdims = tuple(d + out_ndim - ref.dim() for d in ref._sdims)
    extents = [ref._gshape[d] for d in ref._sdims]
    for s in spatial:
        off = out_ndim - s.dim()
        if s._grid is not ref._grid or tuple(d + off for d in s._sdims) != sdims or \
                [s._gshape[d] for d in s._sdims] != extents:
            return None

    def local_of(a):
        if isinstance(a, SpatialTensor):
            return _plain(a)
        if isinstance(a, torch.Tensor):
            kind = _align_operand(a, out_ndim, ref, sdims)
            if kind is None:
                raise _NotLocal
            if kind == "full":
                off = out_ndim - a.dim()
                return _tile_of(a, ref._grid, tuple(d - off for d in sdims))
            return _replicated_operand(a, ref._grid)
        if isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
            return type(a)(local_of(v) for v in a)
        return a

    try:
        largs = [local_of(a) for a in args]
        lkw = {k: local_of(v) for k, v in kwargs.items()}
    except _NotLocal:
        return None
    gshape = _broadcast([t._gshape if isinstance(t, SpatialTensor) else tuple(t.shape) for t in tensors])
    if gshape is None:
        return None
    return largs, lkw, gshape, sdims


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes`` of plain int shapes, or None where they do not broadcast; in plain Python
    because torch's version goes through its symbolic-shape checks (some sixty calls per element-wise op)."""
    out = [1] * max(len(s) for s in shapes)
    for s in shapes:
        for k, v in enumerate(s, len(out) - len(s)):
            if v != 1:
                if out[k] != 1 and out[k] != v:
                    return None
                out[k] = v
    return tuple(out)


class _NotLocal(Exception):
    pass


def _copy_args(input, other, non_blocking=False): ...  # noqa: E704  (Tensor.copy_'s Python binding)


# what becomes of each operand of an element-wise call (:class:`_Decision`)
_AS_IS, _TILE, _CUT, _REPLICATED = range(4)


class _Decision:
    """An element-wise call's decision, made from its operands' layouts and shapes: per operand, whether it is
    passed as it is, is a split tensor's tile, is cut to this tile or joins as a replicated operand; the output's
    global shape and split dimensions; and whether the op changes its first operand in place."""

    __slots__ = ("args", "kwargs", "gshape", "sdims", "grid", "inplace", "cut_dims")

    def __init__(self, func, args, kwargs, spatial: list[SpatialTensor], loc) -> None:
        largs, lkw, self.gshape, self.sdims = loc
        self.grid = spatial[0]._grid
        out_ndim = len(self.gshape)
        self.cut_dims: dict[int, tuple[int, ...]] = {}

        def action(a, key) -> int:
            if isinstance(a, SpatialTensor):
                return _TILE
            if isinstance(a, torch.Tensor):
                if _align_operand(a, out_ndim, spatial[0], self.sdims) == "full":
                    off = out_ndim - a.dim()
                    self.cut_dims[key] = tuple(d - off for d in self.sdims)
                    return _CUT
                return _REPLICATED
            return _AS_IS

        self.args = tuple(action(a, i) for i, a in enumerate(args))
        self.kwargs = {k: action(v, k) for k, v in kwargs.items()}
        self.inplace = _is_inplace(func) or (isinstance(args[0], SpatialTensor) and _inplace_call(kwargs))

    def local(self, a, action: int, key):
        if action == _TILE:
            return _plain(a)
        if action == _CUT:
            return _tile_of(a, self.grid, self.cut_dims[key])
        if action == _REPLICATED:
            return _replicated_operand(a, self.grid)
        return a


def _operand_key(a):
    """An operand as the decision sees it: a split tensor's layout, a plain tensor's shape (and whether it is a
    parameter or needs a gradient, which decide how it joins), or only the kind of a non-tensor value (passed
    through as it is).  A sequence holding tensors has no key (the call is decided afresh)."""
    if isinstance(a, SpatialTensor):
        return (id(a._grid), a._gshape, a._sdims)
    if isinstance(a, torch.Tensor):
        return (a.shape, isinstance(a, torch.nn.Parameter), a.requires_grad)
    if isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
        raise _NotLocal
    return None


def _decide(func, args, kwargs, spatial: list[SpatialTensor]) -> _Decision | None:
    loc = _localize(args, kwargs, spatial)
    # the operand an in-place op changes is its first (a method's self; the input a functional hands on first):
    # a replicated tensor updated from tiles is gathered (the fallback refuses in-place)
    if loc is None or _is_inplace(func) and not isinstance(args[0], SpatialTensor):
        return None
    return _Decision(func, args, kwargs, spatial, loc)


#: the types of the non-tensor operands an element-wise call passes through as given (numbers, ``inplace=``,
#: ``alpha=``): read as they are, without an ``isinstance`` per operand
_SCALARS = frozenset({bool, int, float, complex, str, type(None), torch.dtype})

_Tensor = torch.Tensor


def _elementwise(func, args, kwargs, inplace: bool):
    """The element-wise op ``func`` on split operands (``inplace``: ``func`` changes its first operand, from its
    name), or ``NotImplemented`` for the gather path."""
    x = args[0] if args else None
    if type(x) is SpatialTensor and "out" not in kwargs and not _Trace.active:
        # the common case (an activation, a residual sum of two tiles, a tile scaled by a number): every tensor
        # operand is a split tensor laid out as ``x`` (same grid, global shape and split dimensions) and none is
        # a sequence, so the op on the tiles is the output tile, laid out as ``x``; nothing to decide or cut.
        # (A call with ``out=`` is decided as below: its result is ``out`` itself.)  Checked inline, with no
        # call per operand: this is most of a network's ops.
        grid, gshape, sdims = x._grid, x._gshape, x._sdims
        alike, split_operands = True, False
        for v in (*args[1:], *kwargs.values()) if kwargs else args[1:]:
            if type(v) is SpatialTensor:
                if v._grid is not grid or v._gshape != gshape or v._sdims != sdims:
                    alike = False
                    break
                split_operands = True
            elif type(v) not in _SCALARS and isinstance(v, (_Tensor, list, tuple)):
                alike = False
                break
        if alike:
            # the operands are plain tiles (what autograd saves for backward stays plain, so a dispatch mode
            # seeing backward's ops, e.g. FlopCounterMode, gets no split tensor); an in-place op changes the split
            # tensor itself (an in-place op on an alias would make autograd copy the whole tile back)
            inplace = inplace or ("inplace" in kwargs and kwargs["inplace"] is True)
            with torch._C.DisableTorchFunctionSubclass():
                largs, lkw = args[1:], kwargs
                if split_operands:
                    largs = [v.as_subclass(_Tensor) if type(v) is SpatialTensor else v for v in largs]
                    lkw = {k: v.as_subclass(_Tensor) if type(v) is SpatialTensor else v for k, v in kwargs.items()}
                if inplace:
                    func(x, *largs, **lkw)
                    return x
                out = func(x.as_subclass(_Tensor), *largs, **lkw)
            if type(out) is _Tensor and out.ndim == len(gshape):
                # a new result nobody else holds becomes the split tensor itself (tensor._fresh, inline: this is
                # the path of most ops)
                out.__class__ = SpatialTensor
                out._grid, out._gshape, out._sdims = grid, gshape, sdims  # type: ignore[attr-defined]
                return out
            if isinstance(out, _Tensor) and out.dim() == len(gshape):
                return SpatialTensor.wrap(out, grid, gshape, sdims, fresh=True)
            raise SpatialDispatchError(
                f"spatial: internal error: {_op_name(func)} in {where(grid)} gave an unexpected result")
    spatial = _spatials(args, kwargs)
    if getattr(func, "__name__", "") == "copy_":
        a = bind_call(_copy_args, args, kwargs)
        if a is None or not isinstance(a["other"], SpatialTensor):
            return NotImplemented
    try:
        # of the non-tensor arguments only ``inplace=True`` changes the decision (the others pass through as given)
        key = (func, tuple(_operand_key(a) for a in args), tuple((k, _operand_key(v)) for k, v in kwargs.items()),
               _inplace_call(kwargs))
    except _NotLocal:  # operands inside a list (no hot element-wise op takes one): localized for this call only
        loc = _localize(args, kwargs, spatial)
        if loc is None or _is_inplace(func) and not isinstance(args[0], SpatialTensor):
            return NotImplemented
        largs, lkw, gshape, sdims = loc
        inplace = _is_inplace(func) or (isinstance(args[0], SpatialTensor) and _inplace_call(kwargs))
        grid = spatial[0]._grid
    else:
        dec = spatial[0]._grid.decisions.get(key, lambda: _decide(func, args, kwargs, spatial))
        if dec is None:
            return NotImplemented
        largs = [dec.local(a, act, i) for i, (a, act) in enumerate(zip(args, dec.args))]
        lkw = {k: dec.local(v, dec.kwargs[k], k) for k, v in kwargs.items()}
        gshape, sdims, inplace, grid = dec.gshape, dec.sdims, dec.inplace, dec.grid
    if inplace:
        # on the SpatialTensor itself, not on an alias of it (see SpatialTensor.wrap)
        with torch._C.DisableTorchFunctionSubclass():
            func(args[0], *largs[1:], **lkw)
        return args[0]
    out = func(*largs, **lkw)
    if isinstance(out, torch.Tensor) and out.dim() == len(gshape):
        return SpatialTensor.wrap(out, grid, gshape, sdims, fresh=True)
    raise SpatialDispatchError(
        f"spatial: internal error: {_op_name(func)} in {where(grid)} gave an unexpected result")
