"""Ops along dimensions that are not split, computed on the tile as they are: softmax/log_softmax, ``F.linear``
on the last dimension, ``F.prelu``.
"""

from __future__ import annotations

import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _replicated_operands
from lightning_hpc.spatial.dispatch.calls import _call_with, _norm_dim
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _wrap_like, _wrap_reduced


# the parts of the ops' signatures the handlers read (torch's names and defaults; the builtins have no signature)
def _softmax_args(input, dim=None, *_, **__): ...  # noqa: E704  (dtype and the rest pass through as given)
def _linear_args(input, weight, bias=None): ...  # noqa: E704
def _prelu_args(input, weight): ...  # noqa: E704
def _extremum_args(input, dim=None, keepdim=False): ...  # noqa: E704


@_handles(*_resolve("softmax log_softmax"), signature=_softmax_args)
def _softmax(func, a, args, kwargs):
    x, dim = a["input"], a["dim"]
    if not isinstance(x, SpatialTensor) or dim is None or _norm_dim(dim, x.dim()) in x.split_dims:
        return NotImplemented
    return _wrap_like(_call_with(func, args, kwargs, x, _plain(x)), x)


@_handles(F.linear, signature=_linear_args)
def _linear(func, a, args, kwargs):
    x, w, b = a["input"], a["weight"], a["bias"]
    if not isinstance(x, SpatialTensor) or (x.dim() - 1) in x.split_dims or \
            isinstance(w, SpatialTensor) or isinstance(b, SpatialTensor):
        return NotImplemented
    w, b = _replicated_operands(x._grid, w, b)
    out = F.linear(_plain(x), w, b)
    gshape = tuple(x._gshape[:-1]) + (out.shape[-1],)
    return _wrap_like(out, x, gshape)


@_handles(F.prelu, signature=_prelu_args)
def _prelu(func, a, args, kwargs):
    x, w = a["input"], a["weight"]
    if not isinstance(x, SpatialTensor) or isinstance(w, SpatialTensor) or 1 in x._sdims:
        return NotImplemented
    return _wrap_like(F.prelu(_plain(x), _replicated_operand(w, x._grid)), x)


@_handles(*_resolve("argmax argmin"), signature=_extremum_args)  # (an ``out=`` does not bind: gathered)
def _arg_extremum(func, a, args, kwargs):
    """``argmax``/``argmin`` along a dimension that is not laid out over the grid (a segmentation's class
    per pixel, ``out.argmax(1)``): per pixel, so on the tile; the result stays split."""
    x, dim, keepdim = a["input"], a["dim"], bool(a["keepdim"])
    if not isinstance(x, SpatialTensor) or dim is None:
        return NotImplemented  # over every element: gathered
    d = _norm_dim(dim, x.dim())
    if d in x._sdims:
        return NotImplemented
    return _wrap_reduced(func(_plain(x), d, keepdim), x, [d], keepdim)
