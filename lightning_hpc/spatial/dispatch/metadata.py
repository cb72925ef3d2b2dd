"""Sizes of a split activation are global: ``size()``, ``numel()``, ``len()`` report what one process sees.
"""

from __future__ import annotations

import math

import torch

from lightning_hpc.spatial.dispatch.registry import _handles


@_handles(torch.Tensor.size)
def _size(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return torch.Size(t._gshape) if dim is None else t._gshape[dim]


@_handles(torch.Tensor.numel, torch.numel)
def _numel(func, args, kwargs):
    return int(math.prod(args[0]._gshape))


@_handles(torch.Tensor.__len__)
def _len(func, args, kwargs):
    return args[0]._gshape[0]


@_handles(torch.Tensor.__format__)
def _format(func, args, kwargs):
    return repr(args[0])
