"""Sizes of a split activation are global: ``size()``, ``numel()``, ``len()`` report what one process sees.
"""

from __future__ import annotations

import math

import torch

from lightning_hpc.spatial.dispatch.registry import _handles


# the ops' signatures (the builtins have none; the Python methods name their tensor ``self``)
def _size_args(input, dim=None): ...  # noqa: E704
def _input_args(input): ...  # noqa: E704
def _format_args(input, format_spec): ...  # noqa: E704


@_handles(torch.Tensor.size, signature=_size_args)
def _size(func, a, args, kwargs):
    t, dim = a["input"], a["dim"]
    return torch.Size(t._gshape) if dim is None else t._gshape[dim]


@_handles(torch.Tensor.numel, torch.numel, signature=_input_args)
def _numel(func, a, args, kwargs):
    return int(math.prod(a["input"]._gshape))


@_handles(torch.Tensor.__len__, signature=_input_args)
def _len(func, a, args, kwargs):
    return a["input"]._gshape[0]


@_handles(torch.Tensor.__format__, signature=_format_args)
def _format(func, a, args, kwargs):
    return repr(a["input"])
