"""Tensors made from a split one: ``*_like`` and ``new_*`` (sizes read from ``x.shape`` are global), and the
random ops: ``rand_like``/``randn_like`` and ``F.dropout``/``F.dropout2d`` draw the whole activation's values
from the (same) global stream on every rank and keep this tile's part, so the masks equal one process's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.calls import bind_call
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like


@_handles(*_resolve("zeros_like ones_like empty_like full_like"))
def _like(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor) or "size" in kwargs:
        return NotImplemented
    return _wrap_like(func(_plain(x), *args[1:], **kwargs), x)


@_handles(*_resolve("rand_like randn_like randint_like"))
def _random_like(func, args, kwargs):
    """Drawn for the whole activation from the global stream (as one process draws it), then cut to the tile."""
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    kw = dict(kwargs)
    kw.setdefault("dtype", x.dtype)
    kw.setdefault("device", x.device)
    full = func(torch.empty(x._gshape, dtype=kw["dtype"], device=kw["device"]), *args[1:], **kw)
    return _wrap_like(full[_tile_index(full.shape, x._sdims, x._grid)], x)


@_handles(*_resolve("new_zeros new_ones new_empty new_full new_tensor"))
def _new(func, args, kwargs):
    """Plain tensors of the size the caller gives (sizes read from ``x.shape`` are global)."""
    return func(_plain(args[0]), *args[1:], **kwargs)


@_handles(F.dropout, F.dropout2d)
def _dropout(func, args, kwargs):
    a = bind_call(func, args, kwargs)
    if a is None or not isinstance(a["input"], SpatialTensor):
        return NotImplemented
    x, p, training, inplace = a["input"], a["p"], a["training"], a["inplace"]
    if not training or p == 0.0:
        return x
    if func is F.dropout2d:
        if x.dim() not in (3, 4) or x.dim() == 3:
            return NotImplemented
        shape = tuple(x._gshape[:2]) + (1, 1)
        mask = F.dropout2d(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    else:
        mask = F.dropout(torch.ones(x._gshape, dtype=x.dtype, device=x.device), p, True)
        mask = mask[_tile_index(mask.shape, x._sdims, x._grid)]
    if inplace:
        with torch._C.DisableTorchFunctionSubclass():
            x.mul_(mask)
        return x
    local = _plain(x)
    return _wrap_like(local * mask, x)
