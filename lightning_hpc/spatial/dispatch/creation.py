"""Tensors made from a split one: ``*_like`` and ``new_*`` (sizes read from ``x.shape`` are global), and the
random ops: ``rand_like``/``randn_like`` and ``F.dropout``/``F.dropout2d`` draw the whole activation's values
from the global stream on every rank and keep this tile's part, so the masks equal one process's (the strategy
keeps the generators where the user's script left them and gives every rank rank 0's, :meth:`~lightning_hpc.
spatial.strategy.SpatialParallelStrategy.configure_ddp`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.calls import _call_with
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like


# the part of the ops' signatures the handlers read; the rest passes through as given
def _tensor_args(input, *_, dtype=None, device=None, **__): ...  # noqa: E704


@_handles(*_resolve("zeros_like ones_like empty_like full_like"), signature=_tensor_args)
def _like(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    return _wrap_like(_call_with(func, args, kwargs, x, _plain(x)), x)


@_handles(*_resolve("rand_like randn_like randint_like"), signature=_tensor_args)
def _random_like(func, a, args, kwargs):
    """Drawn for the whole activation from the global stream (as one process draws it), then cut to the tile."""
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    whole = torch.empty(x._gshape, dtype=x.dtype if a["dtype"] is None else a["dtype"],
                        device=x.device if a["device"] is None else a["device"])
    full = _call_with(func, args, kwargs, x, whole)
    return _wrap_like(full[_tile_index(full.shape, x._sdims, x._grid)], x)


@_handles(*_resolve("new_zeros new_ones new_empty new_full new_tensor"), signature=_tensor_args)
def _new(func, a, args, kwargs):
    """Plain tensors of the size the caller gives (sizes read from ``x.shape`` are global)."""
    return _call_with(func, args, kwargs, a["input"], _plain(a["input"]))


@_handles(F.dropout, F.dropout2d)
def _dropout(func, a, args, kwargs):
    if not isinstance(a["input"], SpatialTensor):
        return NotImplemented
    x, p, training, inplace = a["input"], a["p"], a["training"], a["inplace"]
    if not training or p == 0.0:
        return x
    if func is F.dropout2d:
        if x.dim() != 4:
            return NotImplemented  # (not N x C x H x W: gathered)
        shape = tuple(x._gshape[:2]) + (1, 1)
        mask = F.dropout2d(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    else:
        mask = F.dropout(torch.ones(x._gshape, dtype=x.dtype, device=x.device), p, True)
        mask = mask[_tile_index(mask.shape, x._sdims, x._grid)]
    if inplace:
        with torch._C.DisableTorchFunctionSubclass():
            x.mul_(mask)
        return x
    return _wrap_like(_plain(x) * mask, x)
