"""Tensors made from a split one: ``*_like`` and ``new_*`` (sizes read from ``x.shape`` are global), and the
random ops: ``rand_like``/``randn_like``, ``torch.bernoulli``/``Tensor.bernoulli_``, ``Tensor.uniform_``/
``Tensor.normal_``, ``F.dropout``/``F.dropout1d``/``F.dropout2d``/``F.dropout3d`` and ``F.alpha_dropout``/
``F.feature_alpha_dropout`` give each tile its part of
the values one process draws for the whole activation from the same generator state, bit for bit, and leave the
generator where one process's draw leaves it (the strategy keeps the generators where the user's script left them
and gives every rank rank 0's, :meth:`~lightning_hpc.spatial.lightning.strategy.SpatialParallelStrategy.configure_ddp`).

On the CPU a rank holds only its tile's values and a quarter of them more (:mod:`.tile_streams`): torch's CPU
generator is an mt19937, which cannot jump ahead, so every rank still draws as many values as the whole activation
has (to advance the generator as one process does), a piece at a time, and keeps its tile's.  The channel
dropouts' masks are one value per sample and channel.  Elsewhere (CUDA, whose Philox values depend on the draw's
launch layout, or a build whose draws the pieces do not reproduce, checked once per process) the whole tensor is
drawn and cut.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.calls import _call_with, _op_name
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _layout, _plain, _wrap_like
from lightning_hpc.spatial.dispatch.tile_streams import draws_in_pieces, tile_of_draw
from lightning_hpc.spatial.layout.tracing import refuse_trace


# the part of the ops' signatures the handlers read; the rest passes through as given
def _tensor_args(input, *_, dtype=None, device=None, **__): ...  # noqa: E704


@_handles(*_resolve("zeros_like ones_like empty_like full_like"), signature=_tensor_args)
def _like(func, a, args, kwargs):
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    return _wrap_like(_call_with(func, args, kwargs, x, _plain(x)), x)


def _randint_range(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """``(low, high)`` of ``randint_like(input, high)`` / ``(input, low, high)`` (positional or keyword), where
    both are Python integers and ``high - low`` needs one 32-bit word per value (None otherwise: drawn whole)."""
    given = list(args[1:3])
    if "high" in kwargs:
        given.append(kwargs["high"])
    if "low" in kwargs:
        given.insert(0, kwargs["low"])
    if len(given) == 1:
        given.insert(0, 0)
    if len(given) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in given):
        return None
    low, high = int(given[0]), int(given[1])
    return (low, high) if 0 < high - low < 2**32 else None


@_handles(*_resolve("rand_like randn_like randint_like"), signature=_tensor_args)
def _random_like(func, a, args, kwargs):
    """This tile's part of what one process draws for the whole activation from the same generator: drawn in
    pieces where :func:`_drawn_in_tile` can (on the CPU), else drawn whole and cut."""
    refuse_trace(f"a random draw ({_op_name(func)}) on tiles")
    x = a["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    dtype = x.dtype if a["dtype"] is None else a["dtype"]
    name = getattr(func, "__name__", "")
    kind = {"rand_like": "uniform", "randn_like": "normal", "randint_like": "randint"}.get(name)
    bounds = _randint_range(args, kwargs) if kind == "randint" else (None, None)
    if kind is not None and bounds is not None and \
            (a["device"] is None or torch.device(a["device"]).type == "cpu") and \
            kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format):
        out = _drawn_in_tile(x, kind, dtype, kwargs.get("generator"), *bounds)
        if out is not None:
            return _wrap_like(out.requires_grad_(bool(kwargs.get("requires_grad", False))), x)
    whole = torch.empty(x._gshape, dtype=dtype, device=x.device if a["device"] is None else a["device"])
    full = _call_with(func, args, kwargs, x, whole)
    return _wrap_like(full[_tile_index(full.shape, x._sdims, x._grid)], x)


_FLOAT_DTYPES = (torch.float32, torch.float64)
#: the dtypes ``randint_like`` draws in pieces (its integers are one 32-bit word each, whatever the dtype)
_INTEGER_DRAW_DTYPES = (*_FLOAT_DTYPES, torch.int64, torch.int32, torch.int16, torch.uint8)


def _drawn_in_tile(x: SpatialTensor, kind: str, dtype: torch.dtype, gen: torch.Generator | None,
                   a: float | None = None, b: float | None = None) -> Tensor | None:
    """This tile's part of the kind of draw (:func:`~.tile_streams.stream_parts`) one process makes for the whole
    activation, drawn a piece at a time (:func:`~.tile_streams.read_tile`: the tile and a quarter of it held);
    None where the whole must be drawn: off the CPU (CUDA's Philox values depend on the launch's thread layout,
    which a tile's launch does not share), a dtype or a kind this build does not draw as the pieces assume
    (:func:`~.tile_streams.draws_in_pieces`), a tile that is not contiguous (one process's draw then runs in
    another order), or a tensor smaller than a block of normals (torch draws those element by element)."""
    local = _plain(x)
    n = math.prod(x._gshape)
    if not (local.device.type == "cpu" and (gen is None or gen.device.type == "cpu") and
            dtype in (_INTEGER_DRAW_DTYPES if kind == "randint" else _FLOAT_DTYPES) and local.is_contiguous() and
            n >= (16 if kind == "normal" else 1) and draws_in_pieces(kind, dtype)):
        return None
    return tile_of_draw(tuple(x._gshape), _tile_index(x._gshape, x._sdims, x._grid), kind, dtype, gen, a, b)


def _uniform_args(input, a=0.0, to=1.0, *, generator=None): ...  # noqa: E704
def _normal_args(input, mean=0.0, std=1.0, *, generator=None): ...  # noqa: E704
def _bernoulli_args(input, p=None, *, generator=None, out=None): ...  # noqa: E704
def _bernoulli__args(input, p=0.5, *, generator=None): ...  # noqa: E704


def _fill(x: SpatialTensor, values: Tensor) -> SpatialTensor:
    """``x`` with its tile overwritten by ``values`` in place, as the in-place random ops leave it."""
    with torch._C.DisableTorchFunctionSubclass():
        x.copy_(values)
    return x


#: per in-place fill: the kind of draw and the names of its two parameters
_FILLS = {torch.Tensor.uniform_: ("uniform", "a", "to"), torch.Tensor.normal_: ("normal", "mean", "std")}


@_handles(torch.Tensor.uniform_, signature=_uniform_args)
@_handles(torch.Tensor.normal_, signature=_normal_args)
def _uniform_or_normal_(func, a, args, kwargs):
    refuse_trace(f"a random draw ({_op_name(func)}) on tiles")
    x = a["input"]
    kind, first, second = _FILLS[func]
    out = _drawn_in_tile(x, kind, x.dtype, a["generator"], float(a[first]), float(a[second])) if (
        isinstance(x, SpatialTensor)) else None
    return NotImplemented if out is None else _fill(x, out)


@_handles(torch.bernoulli, torch.Tensor.bernoulli, signature=_bernoulli_args)
@_handles(torch.Tensor.bernoulli_, signature=_bernoulli__args)
def _bernoulli(func, a, args, kwargs):
    """``bernoulli(x)`` (``x`` the probabilities), ``bernoulli(x, p)`` and ``x.bernoulli_(p)`` (``p`` a number, or
    probabilities split as ``x`` is): element ``i`` of one process's draw is ``u_i < p_i``, ``u`` the uniforms
    of the probabilities' dtype (float64 for a number), so the tile compares its part of ``u`` with its
    probabilities."""
    refuse_trace(f"a random draw ({_op_name(func)}) on tiles")
    x, p = a["input"], a["p"]
    if not isinstance(x, SpatialTensor) or a.get("out") is not None:
        return NotImplemented
    inplace = func is torch.Tensor.bernoulli_
    if p is None or isinstance(p, SpatialTensor):
        probs = x if p is None else p
        if type(probs) is not SpatialTensor or type(x) is not SpatialTensor or _layout(probs) != _layout(x):
            return NotImplemented  # (probabilities whole, or in another layout: gathered)
        u = _drawn_in_tile(probs, "bernoulli_p", probs.dtype, a["generator"])
        if u is None:
            return NotImplemented
        out = torch.lt(u, _plain(probs)).to(x.dtype)
        if not inplace and probs.requires_grad and torch.is_grad_enabled():
            # torch's bernoulli passes a zero gradient to its probabilities (a parameter's gradient is then zeros,
            # not None, which weight decay and momentum read): adding 0 * p keeps the values and gives it
            out = out + _plain(probs) * 0
    elif isinstance(p, (int, float)) and not isinstance(p, bool):
        out = _drawn_in_tile(x, "bernoulli", x.dtype, a["generator"], float(p))
        if out is None:
            return NotImplemented
    else:
        return NotImplemented
    return _fill(x, out) if inplace else _wrap_like(out, x)


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
    refuse_trace(f"a random draw ({_op_name(func)}) on tiles")
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


#: SELU's negative saturation value, the constant of torch's alpha dropout (Klambauer et al. 2017, Sec. 3)
_SELU_ALPHA = 1.7580993408473766


@_handles(F.alpha_dropout, F.feature_alpha_dropout)
def _alpha_dropout(func, a, args, kwargs):
    """torch's alpha dropout (Klambauer et al. 2017, Eq. 9-10: dropped values set to SELU's saturation, then an
    affine map that keeps mean and variance) on the tile: its part of the noise ``bernoulli_(1 - p)`` one process
    draws (one value per sample and channel for the feature form, drawn whole), then torch's own steps on it:
    ``b = (noise - 1) * alpha a + alpha a p``, ``noise * a``, ``x * noise + b``."""
    refuse_trace(f"a random draw ({_op_name(func)}) on tiles")
    x, p, training, inplace = a["input"], a["p"], a["training"], a["inplace"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    if not training or p == 0.0:
        return x
    if p == 1.0:  # torch multiplies by a zero and draws nothing
        noise, b = torch.zeros((), dtype=x.dtype, device=x.device), None
    else:
        if func is F.feature_alpha_dropout:
            if x.dim() < 2 or {0, 1} & set(x.split_dims):
                return NotImplemented  # (torch's error, or samples or channels split: gathered)
            noise = torch.empty(tuple(x._gshape[:2]) + (1,) * (x.dim() - 2), dtype=x.dtype,
                                device=x.device).bernoulli_(1.0 - p)
        else:
            drawn = _drawn_in_tile(x, "bernoulli", x.dtype, None, 1.0 - p)
            noise = drawn if drawn is not None else torch.empty(x._gshape, dtype=x.dtype, device=x.device).bernoulli_(
                1.0 - p)[_tile_index(x._gshape, x._sdims, x._grid)]
        scale = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
        b = noise.add(-1).mul_(_SELU_ALPHA * scale).add_(_SELU_ALPHA * scale * p)
        noise.mul_(scale)
    if inplace:
        with torch._C.DisableTorchFunctionSubclass():
            x.mul_(noise)
            if b is not None:
                x.add_(b)
        return x
    out = _plain(x) * noise
    return _wrap_like(out if b is None else out.add_(b), x)


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
    the global generator, which ends where drawing the whole tensor leaves it: the tile's uniforms read a quarter
    of the tile at a time (:func:`~.tile_streams.read_tile`), each piece compared with ``q`` into the mask."""
    keep = torch.empty([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype=torch.bool)
    return tile_of_draw(shape, index, "uniform", torch.float64, take=lambda u, dest: torch.lt(u, q, out=dest),
                        out=keep)
