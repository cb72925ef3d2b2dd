"""The windows of a traced layer along each spatial dimension: which input range an output range reads, and from
them the exact halo a split needs (section III-A: per neighbour, the rows the output tile reads beyond the tile; in
3-D faces, edges and corners, so halo bytes follow the surface-to-volume ratio).

A layer's windows are those of the op it calls that reads its neighbours' rows, as that op's handler registered
them (:data:`lightning_hpc.spatial.dispatch.registry.OP_WINDOWS`: convolutions, transposed convolutions,
max / average pooling, interpolation, in 1, 2 or 3 dimensions): the layer's forward is probed on a meta input
until it calls such an op, so a user's layer that calls ``F.conv2d`` itself, or pads first, is seen as the tile
kernels run it, and a new halo op is known here by its registration alone.

The acceptance test of a split is the halo plan's own (:func:`~lightning_hpc.spatial.kernels.check_partition`):
a tile thinner than its halo is refused the same way at setup and here.  Plain torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hpc.spatial.dispatch.calls import _inplace_call, _is_inplace, bind_call
from lightning_hpc.spatial.dispatch.registry import OP_WINDOWS
from lightning_hpc.spatial.kernels import check_partition
from lightning_hpc.spatial.layout.halo_exchange import PartitionError, Window1d

__all__ = ["layer_windows", "split_works", "halo_elements", "tile_halo_blocks", "CONVOLUTIONS", "TRANSPOSED"]

#: the layer types the planner's cost model counts the arithmetic of (their windows come from the ops they call)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)




class _Found(Exception):
    def __init__(self, windows: tuple | None) -> None:
        self.windows = windows


class _FirstHaloOp(TorchFunctionMode):
    """Stops a layer's forward at the first op with registered windows (raising :class:`_Found` with them), before
    the op runs; also at the first in-place op, before it could change the layer's state (a running statistic):
    such a layer is not probed further.  Windows count for an op applied to the layer's input ``x``, or to ``x``
    padded along its spatial dimensions (``padding_mode='reflect'``, a ``Conv2dSame``-style layer: the padding
    becomes the window's); after other ops the op's extents are not the layer's, and the op dispatch checks the
    split when it runs."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x = x
        self.padded: torch.Tensor | None = None
        self.pads: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = OP_WINDOWS.get(func)
        if entry is not None:
            signature, windows = entry
            a = bind_call(signature, args, kwargs)
            x = a.get("input") if a is not None else None
            if x is None or (x is not self.x and x is not self.padded):
                raise _Found(None)
            try:
                found = windows(a, tuple(x.shape[2:]))
            except ValueError:
                raise _Found(None) from None  # a call without a tiled form: the op dispatch gathers it
            if x is self.padded:
                if not all(isinstance(w, Window1d) for w in found):
                    raise _Found(None)
                found = tuple(dataclasses.replace(w, padding=w.padding + lo,
                                                  padding_hi=None if lo == hi and w.symmetric else w.pad_after + hi)
                              for w, (lo, hi) in zip(found, self.pads))
            raise _Found(found)
        if _is_inplace(func) or _inplace_call(kwargs) or kwargs.get("out") is not None:
            raise _Found(None)
        out = func(*args, **kwargs)
        if func is F.pad and args and args[0] is self.x and self.padded is None:
            a = bind_call(F.pad, args, kwargs)
            pad = list(a["pad"]) if a is not None else []
            k = self.x.dim() - 2
            if len(pad) == 2 * k and all(v >= 0 for v in pad):  # (last dimension first, as torch takes them)
                self.padded = out
                self.pads = [(pad[2 * (k - 1 - d)], pad[2 * (k - 1 - d) + 1]) for d in range(k)]
        return out


_PROBED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], tuple | None]] = weakref.WeakKeyDictionary()


def layer_windows(module: nn.Module | None, in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple | None:
    """One window per spatial dimension of ``module`` for an input of ``in_shape`` (N, C, *spatial): those of the
    first op with registered windows its forward calls (probed on a meta input, nothing computed), or None for a
    layer that calls none (element-wise layers; 1 x 1 stride-1 convolutions excepted: they get windows too, whose
    halo is empty), calls one in a form without a tiled kernel (gathered by the op dispatch), changes a tensor in
    place before it, or fails on a meta input.  The windows are the tile kernels' own, so the setup check, the
    planner and the kernels accept the same splits.  Probed once per module and input shape."""
    if module is None or len(in_shape) < 3:
        return None
    shape = tuple(int(v) for v in in_shape)
    seen = _PROBED.setdefault(module, {})
    if shape not in seen:
        seen[shape] = _probe(module, shape)
    return seen[shape]


def _probe(module: nn.Module, shape: tuple[int, ...]) -> tuple | None:
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    x = torch.empty(shape, dtype=dtype, device="meta")
    try:
        with torch.no_grad(), _FirstHaloOp(x):
            module.forward(x)  # (not its hooks: a hook of the run, K-FAC's, must not see the probe)
    except _Found as found:
        return found.windows
    except Exception:  # noqa: BLE001  (a layer that cannot run on a meta input reads no windows we can know)
        return None
    return None


def split_works(windows: Sequence[Any] | None, extents: Sequence[int], parts: Sequence[int]) -> bool:
    """Whether every tile of ``extents`` split ``parts`` holds at least one row and the halo it needs."""
    if any(n < p for n, p in zip(extents, parts)):
        return False
    if windows is None:
        return True
    try:
        check_partition(extents, parts, windows)
    except PartitionError:
        return False
    return True


def tile_halo_blocks(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]
                     ) -> dict[tuple[int, ...], list[int]]:
    """Per tile, the elements of one sample and channel it receives: one block per neighbour in {-1, 0, 1}^k
    (faces, edges, corners), each the product over dimensions of the received rows (a moved dimension) or the
    tile's own rows its output reads (an unmoved one)."""
    plans = check_partition(extents, parts, windows)
    out: dict[tuple[int, ...], list[int]] = {}
    for index in itertools.product(*(range(p) for p in parts)):
        blocks = out[index] = []
        for delta in itertools.product((-1, 0, 1), repeat=len(parts)):
            if not any(delta) or not all(0 <= i + d < p for i, d, p in zip(index, delta, parts)):
                continue
            sizes = [plan.recv_range(i, d) for plan, i, d in zip(plans, index, delta)]
            count = math.prod(max(hi - lo, 0) for lo, hi in sizes)
            if count:
                blocks.append(count)
    return out


def halo_elements(windows: Sequence[Any], extents: Sequence[int], parts: Sequence[int]) -> list[int]:
    """Per message of the busiest tile (the one receiving the most), the elements of one sample and channel it
    receives (:func:`tile_halo_blocks`)."""
    if all(p == 1 for p in parts):
        return []
    return max(tile_halo_blocks(windows, extents, parts).values(), key=sum)
