"""Ops along dimensions that are not split, computed on the tile as they are: softmax/log_softmax, ``F.linear``
on the last dimension, ``F.prelu``.
"""

from __future__ import annotations

import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _replicated_operands
from lightning_hpc.spatial.dispatch.calls import _norm_dim
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like, dims_without


@_handles(*_resolve("softmax log_softmax"))
def _softmax(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or _norm_dim(dim, x.dim()) in x.split_dims:
        return NotImplemented
    rest = [_plain(a) if isinstance(a, SpatialTensor) else a for a in args]
    return _wrap_like(func(*rest, **kwargs), x)


@_handles(F.linear)
def _linear(func, args, kwargs):
    x = args[0]
    params = list(args[1:]) + list(kwargs.values())
    if not isinstance(x, SpatialTensor) or (x.dim() - 1) in x.split_dims or \
            any(isinstance(p, SpatialTensor) for p in params):
        return NotImplemented
    w = args[1] if len(args) > 1 else kwargs["weight"]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    w, b = _replicated_operands(x._grid, w, b)
    out = F.linear(_plain(x), w, b)
    gshape = tuple(x._gshape[:-1]) + (out.shape[-1],)
    return _wrap_like(out, x, gshape)


@_handles(F.prelu)
def _prelu(func, args, kwargs):
    x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
    if not isinstance(x, SpatialTensor) or isinstance(w, SpatialTensor) or 1 in x._sdims:
        return NotImplemented
    return _wrap_like(F.prelu(_plain(x), _replicated_operand(w, x._grid)), x)


@_handles(*_resolve("argmax argmin"))
def _arg_extremum(func, args, kwargs):
    """``argmax``/``argmin`` along a dimension that is not laid out over the grid (a segmentation's class
    per pixel, ``out.argmax(1)``): per pixel, so on the tile; the result stays split."""
    x = args[0]
    if not isinstance(x, SpatialTensor) or len(args) > 3 or set(kwargs) - {"dim", "keepdim"}:
        return NotImplemented
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dim is None:
        return NotImplemented  # over every element: gathered
    d = _norm_dim(dim, x.dim())
    if d in x._sdims:
        return NotImplemented
    out = func(_plain(x), d, keepdim)
    gshape = list(x._gshape)
    if keepdim:
        gshape[d] = 1
        return _wrap_like(out, x, gshape)
    del gshape[d]
    return _wrap_like(out, x, gshape, dims_without(x._sdims, [d]))
