"""Global reductions: ``sum``/``mean``/``nansum`` over the split dimensions are summed over the spatial group
(and divided by the global count), so a mean equals one process's; vector p-norms follow from the sum.
"""

from __future__ import annotations

import math

import torch

from lightning_hpc.spatial.dispatch.calls import _norm_dim
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_reduced
from lightning_hpc.spatial.layout.collectives import all_reduce_replicated


# the ops' signatures (torch's names and defaults; ``axis`` is numpy's name of ``dim``)
def _reduce_args(input, dim=None, keepdim=False, *, dtype=None, axis=None): ...  # noqa: E704
def _norm_args(input, p="fro", dim=None, keepdim=False, out=None, dtype=None): ...  # noqa: E704
def _vector_norm_args(input, ord=2, dim=None, keepdim=False, *, dtype=None, out=None): ...  # noqa: E704


@_handles(*_resolve("sum mean nansum"), signature=_reduce_args)
def _reduce(func, a, args, kwargs):
    x, keepdim, dtype = a["input"], a["keepdim"], a["dtype"]
    dim = a["dim"] if a["axis"] is None else a["axis"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    every = dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0)  # over all dimensions
    if every:
        dims = list(range(x.dim()))
    else:
        dims = [_norm_dim(d, x.dim()) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    name = func.__name__
    local = _plain(x)
    split = set(x.split_dims)
    if not split and not keepdim and set(dims) & set(x._sdims):
        # no dimension divided (a grid of one tile: the tile is the whole tensor) and a laid-out dimension reduced
        # away: the serial op's result, plain (a layout without that dimension has nothing to say)
        return func(local, dtype=dtype) if every else func(local, dim=dims, keepdim=False, dtype=dtype)
    if not split & set(dims):  # along unsplit dimensions only: stays split
        if every:
            return NotImplemented
        return _wrap_reduced(func(local, dim=dims, keepdim=keepdim, dtype=dtype), x, dims, keepdim)
    if not split <= set(dims):
        return NotImplemented  # partly over the split dimensions: only a subgroup would reduce
    local_sum = torch.nansum if name == "nansum" else torch.sum
    summed = local_sum(local, dtype=dtype) if every else local_sum(local, dim=dims, keepdim=keepdim, dtype=dtype)
    total = all_reduce_replicated(summed, x._grid.group)
    if name == "mean":
        count = math.prod(x._gshape[d] for d in dims)
        total = total / count
    return total


@_handles(torch.linalg.vector_norm, signature=_vector_norm_args)
@_handles(torch.norm, torch.Tensor.norm, signature=_norm_args)
def _norm(func, a, args, kwargs):
    """Vector p-norms (``p`` finite, ``"fro"`` = 2) as ``sum(|x|^p)^(1/p)``: the sum is the global reduction
    above, so a gradient norm taken in a hook or a logged activation norm is one process's value."""
    x, dim, keepdim, dtype = a["input"], a["dim"], a["keepdim"], a["dtype"]
    p = a["ord"] if "ord" in a else a["p"]
    p = 2.0 if p == "fro" else p
    if not isinstance(x, SpatialTensor) or a["out"] is not None:
        return NotImplemented  # out=: left to the general path
    if not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
        return NotImplemented  # inf / 0 / nuclear norms: gathered
    v = x if dtype is None else x.to(dtype)
    powered = v.abs() ** p
    total = powered.sum() if dim is None else powered.sum(dim=dim, keepdim=keepdim)
    if isinstance(total, SpatialTensor):
        return NotImplemented  # along unsplit dimensions only
    return total ** (1.0 / p)
