"""Tensors made from a split one: ``*_like`` and ``new_*`` (sizes read from ``x.shape`` are global), and the
random ops: ``rand_like``/``randn_like`` and ``F.dropout``/``F.dropout1d``/``F.dropout2d``/``F.dropout3d`` take
the values one process draws for the whole activation from the global stream and keep this tile's part, so the
masks equal one process's (the strategy keeps the generators where the user's script left them and gives every
rank rank 0's, :meth:`~lightning_hpc.spatial.lightning.strategy.SpatialParallelStrategy.configure_ddp`).

``F.dropout`` on the CPU holds only the tile's mask and a quarter of it in uniforms (:func:`_tile_keep`), where
this torch draws the mask as a serial stream (checked once, :func:`_serial_dropout_stream`): torch's CPU generator
is an mt19937, which cannot jump ahead, so every rank still draws the whole activation's values (to advance the
stream as one process does), but keeps none but its tile's. The channel dropouts' mask is one value per sample
and channel; ``rand_like``/``randn_like`` and other devices draw the whole tensor.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

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


#: the channel dropouts: the numbers of dimensions each takes (torch warns about the others and still computes
#: them, except ``dropout1d``), and whether it reads a tensor of that many dimensions as one sample without a batch
#: dimension (torch draws one mask value per channel then, per sample and channel otherwise)
_CHANNEL_DROPOUT: dict = {
    F.dropout1d: (lambda n: n in (2, 3), lambda n: n == 2),
    F.dropout2d: (lambda n: n >= 2, lambda n: False),
    F.dropout3d: (lambda n: n >= 2, lambda n: n != 5),
}


@_handles(F.dropout, *_CHANNEL_DROPOUT)
def _dropout(func, a, args, kwargs):
    if not isinstance(a["input"], SpatialTensor):
        return NotImplemented
    x, p, training, inplace = a["input"], a["p"], a["training"], a["inplace"]
    if not training or p == 0.0:
        return x
    if func in _CHANNEL_DROPOUT:
        # one mask value per (sample, channel), drawn as one process draws it: the same op on ones of the mask's
        # shape draws the same values (torch's feature noise is input.new_empty(N, C, 1, ...).bernoulli_(1 - p))
        takes, unbatched = _CHANNEL_DROPOUT[func]
        if not takes(x.dim()):
            return NotImplemented  # (torch's error, from the gather path)
        kept = 1 if unbatched(x.dim()) else 2
        if set(range(kept)) & set(x.split_dims):
            return NotImplemented  # samples or channels split: gathered
        shape = tuple(x._gshape[:kept]) + (1,) * (x.dim() - kept)
        mask = func(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    elif p == 1.0:  # torch multiplies by a zero and draws nothing
        mask = torch.zeros((), dtype=x.dtype, device=x.device)
    elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and 0.0 < p < 1.0 and (
            _serial_dropout_stream()):
        # torch's own steps on the kept elements: bernoulli_(1 - p) in the input's dtype, then div_(1 - p)
        mask = _tile_keep(x._gshape, _tile_index(x._gshape, x._sdims, x._grid), 1.0 - p).to(x.dtype).div_(1.0 - p)
    else:
        mask = F.dropout(torch.ones(x._gshape, dtype=x.dtype, device=x.device), p, True)
        mask = mask[_tile_index(mask.shape, x._sdims, x._grid)]
    if inplace:
        with torch._C.DisableTorchFunctionSubclass():
            x.mul_(mask)
        return x
    return _wrap_like(_plain(x) * mask, x)


@functools.cache
def _serial_dropout_stream() -> bool:
    """Whether ``F.dropout`` on a contiguous CPU tensor keeps element ``i`` (flat order) where the ``i``-th
    float64 uniform of the global generator is below ``1 - p``, and advances the generator by one such draw per
    element, drawn in any pieces (torch's serial CPU ``bernoulli_``).  Checked once on this build, with the
    generator's state put back; a build whose draw differs (e.g. one per thread block) keeps the whole-mask draw."""
    state = torch.get_rng_state()
    try:
        n, q = 3 * 4096 + 5, 0.7
        for dtype in (torch.float32, torch.float64):
            torch.set_rng_state(state)
            expected = F.dropout(torch.ones(n, dtype=dtype), 1.0 - q, True)
            expected_state = torch.get_rng_state()
            torch.set_rng_state(state)
            u = torch.cat([torch.rand(n // 3, dtype=torch.float64), torch.rand(n - n // 3, dtype=torch.float64)])
            if not (torch.equal((u < q).to(dtype).div_(q), expected) and torch.equal(torch.get_rng_state(),
                                                                                      expected_state)):
                return False
        return True
    finally:
        torch.set_rng_state(state)


def _tile_keep(shape: tuple[int, ...], index: tuple[slice, ...], q: float) -> Tensor:
    """This tile's part (``index``) of the keep mask ``rand(shape, float64) < q`` of the whole tensor, drawn from
    the global generator, which ends where drawing the whole tensor leaves it.

    The stream runs in flat order. Along the dimensions before the first split one (``f``: samples, channels and
    the unsplit leading spatial dimensions) the tile holds every index, so the tensor is a sequence of blocks (one
    index of those dimensions, every later one whole). Small blocks are drawn several at a time, in chunks of at
    most a quarter of the tile, and the tile's part of each kept; a block larger than that is walked along
    dimension ``f``: the rows outside the tile drawn into the buffer and dropped, the tile's rows drawn a quarter
    of the tile at a time (with every later dimension whole) and the tile's part kept. Besides the tile's mask, one
    buffer of float64 values is held, a quarter of the tile's elements (or one row of dimension ``f`` where that
    is larger); the Python loop runs a few times per part."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    split = [d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])]
    if not split:
        return torch.rand(shape, dtype=torch.float64) < q
    keep = torch.empty([b - a for a, b in bounds], dtype=torch.bool)
    f = split[0]
    block = math.prod(shape[f:])
    blocks = keep.view(-1, *keep.shape[f:])  # one entry per block, each whole in the tile
    budget = max(keep.numel() // 4, 1)
    if block <= budget:
        per = budget // block
        buffer = torch.empty(per * block, dtype=torch.float64)
        tile_part = (slice(None), *(slice(*bounds[d]) for d in range(f, len(shape))))
        for first in range(0, blocks.shape[0], per):
            n = min(per, blocks.shape[0] - first)
            u = buffer[: n * block].view(n, *shape[f:])
            torch.rand(u.shape, dtype=torch.float64, out=u)
            torch.lt(u[tile_part], q, out=blocks[first : first + n])
        return keep
    a, b = bounds[f]
    inner = math.prod(shape[f + 1:])
    per = max(budget // inner, 1)  # rows of dimension f drawn at once
    buffer = torch.empty(min(per, b - a) * inner, dtype=torch.float64)
    later = (slice(None), *(slice(*bounds[d]) for d in range(f + 1, len(shape))))

    def skip(count: int) -> None:
        while count > 0:
            k = min(count, buffer.numel())
            torch.rand(k, dtype=torch.float64, out=buffer[:k])
            count -= k

    gap = a * inner
    for i in range(blocks.shape[0]):
        skip(gap)
        for row in range(a, b, per):
            n = min(per, b - row)
            u = buffer[: n * inner].view(n, *shape[f + 1:])
            torch.rand(u.shape, dtype=torch.float64, out=u)
            torch.lt(u[later], q, out=blocks[i][row - a : row - a + n])
        gap = (shape[f] - b + a) * inner
    skip((shape[f] - b) * inner)
    return keep
