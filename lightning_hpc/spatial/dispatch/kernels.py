"""Tiled convolution, pooling and interpolation calls on split activations, in 1, 2 and 3 spatial dimensions.

Each handler gets the call's arguments bound once against the op's signature (``inspect.Signature.bind`` of a stub
with torch's parameter names and defaults: positional and keyword forms alike, nothing read by index), checks
the layout (``N x C x spatial...`` split along its spatial dimensions in order), and runs the plain kernel of
:mod:`lightning_hpc.spatial.kernels` on the local tile (halo exchange of exactly the rows the op's windows read,
section III-A):

* ``F.conv1d/2d/3d`` (any stride, padding incl. ``'same'`` with even kernels, dilation, groups),
  ``F.conv_transpose1d/2d/3d``;
* ``F.max_pool1d/2d/3d`` and ``F.avg_pool1d/2d/3d`` (``ceil_mode``, ``count_include_pad``, ``divisor_override``);
  a window as large as the whole extent is the global pooling;
* ``F.interpolate`` (nearest, nearest-exact, linear, bilinear, trilinear; ``size`` or ``scale_factor``);
* ``F.adaptive_avg_pool1d/2d/3d`` and ``F.adaptive_max_pool1d/2d/3d`` (partial window sums / maxima combined
  over the group; the result is replicated, like a global mean).

Weights and biases are replicated operands (their gradients are this tile's partial sums, which the strategy sums
over the spatial group).  Calls a kernel cannot do exactly (an unbatched input, a layout the kernels do not take,
``return_indices`` of a sliding max pool, antialiasing) are declined: the gather path computes them exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial import kernels as K
from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _replicated_operands
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.state import SpatialDispatchError, where
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _channels_first, _fresh, _plain, _wrap_like
from lightning_hpc.spatial.kernels.adaptive import adaptive_output_size
from lightning_hpc.spatial.kernels.plan import ntuple
from lightning_hpc.spatial.layout.halo_exchange import PartitionError
from lightning_hpc.spatial.layout.tiling import SpatialGrid


# -- the ops' signatures (torch's parameter names and defaults) -------------------------------------------------
def _conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1): ...  # noqa: E704
def _conv_transpose(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1): ...  # noqa: E704
def _max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False): ...  # noqa: E704
def _avg_pool(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,  # noqa: E704
              divisor_override=None): ...
def _interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,  # noqa: E704
                 recompute_scale_factor=None, antialias=False): ...
def _adaptive(input, output_size, return_indices=False): ...  # noqa: E704


# -- the ops' windows (registered with their handlers: the setup check and the planner read the same) --------------
def _conv_windows(a: dict[str, Any], extents: Any) -> tuple:
    return K.convolution_windows(a["weight"].shape, a["stride"], a["padding"], a["dilation"])


def _transposed_windows(a: dict[str, Any], extents: Any) -> tuple:
    return K.transposed_windows(a["weight"].shape, a["stride"], a["padding"], a["output_padding"], a["dilation"])


def _pool_windows(k: int, kind: str) -> Callable[[dict[str, Any], Any], tuple]:
    def windows(a: dict[str, Any], extents: Any) -> tuple:
        return K.pooling_windows(k, a["kernel_size"], a["stride"], a["padding"], a["dilation"] if kind == "max" else 1,
                                 a["ceil_mode"])
    return windows


def _interpolation_windows(a: dict[str, Any], extents: Any) -> tuple:
    return K.interpolation_windows(extents, a["size"], a["scale_factor"], a["mode"], a["align_corners"],
                                   a["recompute_scale_factor"])


def _spatial_input(a: dict[str, Any], k: int) -> SpatialTensor | None:
    """The split input of a ``k``-D op when it is laid out as the kernels take it."""
    x = a["input"]
    return x if _channels_first(x, k) else None


def _extents(x: SpatialTensor) -> tuple[int, ...]:
    return tuple(x._gshape[d] for d in x._sdims)


def _run(op: str, grid: SpatialGrid, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except PartitionError as e:
        raise SpatialDispatchError(f"spatial: {op} in {where(grid)}: {e}") from None


# -- convolution ---------------------------------------------------------------------------------------------------
def _convolution(func, a, args, kwargs):
    # the number of spatial dimensions by the op (a table, not a partial: no keyword call per convolution)
    k, name = _CONV_OPS[func]
    x, weight, bias = a["input"], a["weight"], a["bias"]
    # (SpatialTensor has no subclasses: ``type(...) is`` is its isinstance, one call less on every convolution)
    if type(weight) is not nn.Parameter and (not isinstance(weight, torch.Tensor) or type(weight) is SpatialTensor) \
            or type(bias) is SpatialTensor:
        return NotImplemented
    stride, padding, dilation, groups = a["stride"], a["padding"], a["dilation"], a["groups"]
    key, cached = None, True
    if type(x) is SpatialTensor:
        # (_hashable's conversion inline: this is every convolution's per-call path)
        key = (name, x._gshape, x._sdims, weight.shape, tuple(stride) if type(stride) is list else stride,
               tuple(padding) if type(padding) is list else padding,
               tuple(dilation) if type(dilation) is list else dilation, groups, x._grid.policy.overlap)
        # a call decided before is replayed without re-reading its layout (an unhashable key: decided per call)
        try:
            cp = x._grid.decisions.table.get(key, _UNDECIDED)
        except TypeError:
            cp, cached = _UNDECIDED, False
        if cp is not _UNDECIDED:
            return NotImplemented if cp is None else _run_conv_tile(x, weight, bias, cp)
    if k == 2 and isinstance(x, SpatialTensor) and x.dim() == 4 and x._sdims == (3, 2) and weight.dim() == 4:
        # split along W, H (after a transpose(2, 3)): the convolution of the transposed input with the transposed
        # kernel, transposed back, is the same convolution, and that one is tiled
        def swap(v: Any) -> Any:
            return v if isinstance(v, str) else ntuple(v, 2, "argument")[::-1]

        return F.conv2d(x.transpose(2, 3), weight.transpose(2, 3), bias, swap(a["stride"]), swap(a["padding"]),
                        swap(a["dilation"]), a["groups"]).transpose(2, 3)
    x = _spatial_input(a, k)
    if x is None or weight.dim() != k + 2:
        return NotImplemented
    assert key is not None  # x is the split input the key was made from

    def decide() -> K.ConvPlan | None:
        channels = x._gshape[1]
        if weight.shape[1] * int(groups) != channels:
            raise SpatialDispatchError(
                f"spatial: F.conv{k}d in {where(x._grid)}: the input has {channels} channels but the weight "
                f"{tuple(weight.shape)} with groups={groups} expects {weight.shape[1] * int(groups)}; fix the "
                f"layer's in_channels")
        try:
            return _run(f"F.conv{k}d", x._grid, lambda: K.plan_conv(x._grid, _extents(x), weight.shape, stride, padding,
                                                           dilation, int(groups), overlap=x._grid.policy.overlap,
                                                           tile=_plain(x)))
        except ValueError:
            return None  # an argument torch refuses: its own error from the gathered call

    cp = x._grid.decisions.get(key, decide) if cached else decide()
    return NotImplemented if cp is None else _run_conv_tile(x, weight, bias, cp)


#: per convolution op: its number of spatial dimensions and the first entry of its decision key
_CONV_OPS: dict[Callable, tuple[int, str]] = {f: (k, f"conv{k}d") for k in (1, 2, 3) for f in _resolve(f"conv{k}d")}

#: a decision cache miss (None is a decision: the call is gathered)
_UNDECIDED: Any = object()


def _run_conv_tile(x: SpatialTensor, weight: torch.Tensor, bias: torch.Tensor | None, cp: K.ConvPlan) -> SpatialTensor:
    """The convolution ``cp`` plans on ``x``'s tile, as a split tensor."""
    grid = x._grid
    # K-FAC capturing the statistics of the layer whose weight this is gets the tile's padded box, through the
    # registry the strategy keeps on the grid (spatial.dispatch.kfac_contract)
    tiled = grid.tiled_layers
    record = tiled.recorder(weight) if tiled is not None else None
    weight = _replicated_operand(weight, grid)
    if bias is not None:
        bias = _replicated_operand(bias, grid)
    out = K.run_conv(_plain(x), weight, bias, cp, record)
    return _fresh(out, grid, (x._gshape[0], weight.shape[0], *cp.out_extents), x._sdims)


def _hashable(v: Any) -> Any:
    """A call argument as part of a decision key (torch takes lists where it takes tuples)."""
    return tuple(v) if isinstance(v, list) else v


def _hashable_key(key: tuple) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _transposed(func, a, args, kwargs, k: int):
    x = _spatial_input(a, k)
    if x is None:
        return NotImplemented
    weight, bias, groups = a["weight"], a["bias"], int(a["groups"])
    if not isinstance(weight, torch.Tensor) or isinstance(weight, SpatialTensor) or isinstance(bias, SpatialTensor) \
            or weight.dim() != k + 2 or x._gshape[1] != weight.shape[0]:
        return NotImplemented  # the serial op's error, from the gathered call
    try:
        windows = _transposed_windows(a, None)
    except ValueError:
        return NotImplemented
    extents = _extents(x)
    weight, bias = _replicated_operands(x._grid, weight, bias)
    try:
        out = K.conv_transpose(_plain(x), weight, bias, x._grid, extents, a["stride"], a["padding"],
                               a["output_padding"], groups, a["dilation"])
    except PartitionError:
        return NotImplemented  # a tile thinner than its halo, or an output tile in a stride gap: gathered (exact)
    return _wrap_like(out, x, (x._gshape[0], weight.shape[1] * groups, *K.output_extents(extents, windows)))


# -- pooling -------------------------------------------------------------------------------------------------------
def _whole_window(x: SpatialTensor, windows: tuple) -> bool:
    """A window that is the whole extent (``F.avg_pool2d(x, x.shape[2:])``): one output per channel, the global
    pooling (a tile is smaller than such a window, so the halo plan has none)."""
    return all(w.kernel == n and w.padding == 0 and w.dilation == 1 for w, n in zip(windows, _extents(x)))


def _pool(func, a, args, kwargs, k: int, kind: str, windows_of: Callable[[dict[str, Any], Any], tuple]):
    x = _spatial_input(a, k)
    if x is None:
        return NotImplemented
    if kind == "max" and a["return_indices"]:
        return NotImplemented  # indices of a sliding max pool would be tile positions: gathered
    args_ = (a["kernel_size"], a["stride"], a["padding"], a["dilation"] if kind == "max" else 1, a["ceil_mode"],
             True if kind == "max" else a["count_include_pad"], None if kind == "max" else a["divisor_override"])
    key = (f"{kind}_pool", x._gshape, x._sdims, *map(_hashable, args_))

    def decide() -> K.PoolPlan | str | None:
        try:
            windows = windows_of(a, None)
        except ValueError:
            return None  # torch's own error, from the gathered call
        if _whole_window(x, windows) and not (kind == "avg" and a["divisor_override"] is not None):
            return "global"
        op = f"F.{kind}_pool{k}d"
        return _run(op, x._grid, lambda: K.plan_pool(x._grid, _extents(x), kind, *args_, tile=_plain(x)))

    pp = x._grid.decisions.get(key, decide) if _hashable_key(key) else decide()
    if pp is None:
        return NotImplemented
    if isinstance(pp, str):  # "global": the global pooling
        if kind == "avg":
            return x.mean(tuple(range(2, 2 + k)), keepdim=True)  # (the global reduction)
        return _run(f"F.max_pool{k}d", x._grid, lambda: K.adaptive_max_pool(_plain(x), x._grid, _extents(x), (1,) * k))
    return _wrap_like(K.run_pool(_plain(x), pp), x, (x._gshape[0], x._gshape[1], *pp.out_extents))


# -- interpolation -------------------------------------------------------------------------------------------------
@_handles(F.interpolate, signature=_interpolate, windows=_interpolation_windows)
def _interpolate_call(func, a, args, kwargs):
    x = a["input"]
    if not _channels_first(x) or a["antialias"]:  # (any number of split dimensions: the mode says which it takes)
        return NotImplemented
    size, scale, mode, corners, recompute = (a["size"], a["scale_factor"], a["mode"], a["align_corners"],
                                             a["recompute_scale_factor"])
    local = _plain(x)
    key = ("interpolate", x._gshape, x._sdims, _hashable(size), _hashable(scale), mode, corners, recompute,
           local.dtype, local.device)

    def decide() -> K.InterpolationPlan | None:
        try:
            return _run(f"F.interpolate({mode})", x._grid, lambda: K.plan_interpolation(
                x._grid, _extents(x), x.dim(), size, scale, mode, corners, recompute, dtype=local.dtype,
                device=local.device, tile=local))
        except ValueError:
            return None  # a mode without a tiled form (area, bicubic) or torch's own error: gathered

    ip = x._grid.decisions.get(key, decide) if _hashable_key(key) else decide()
    if ip is None:
        return NotImplemented
    out = K.run_interpolation(local, ip)
    return _wrap_like(out, x, (x._gshape[0], x._gshape[1], *ip.out_extents))


# -- adaptive pooling ----------------------------------------------------------------------------------------------
def _adaptive_pool(func, a, args, kwargs, k: int, kind: str):
    """Size 1 of an average: the global mean.  Otherwise each output window's partial sum (maximum) on each tile,
    combined over the spatial group (:mod:`lightning_hpc.spatial.kernels.adaptive`); the result is replicated."""
    x = _spatial_input(a, k)
    if x is None:
        return NotImplemented
    extents = _extents(x)
    try:
        size = adaptive_output_size(a["output_size"], extents)
    except (ValueError, TypeError):
        return NotImplemented  # None entries or an invalid size: gathered, the serial op's error
    if kind == "avg":
        if all(s == 1 for s in size):
            return x.mean(tuple(range(2, 2 + k)), keepdim=True)  # (the global reduction)
        return _run(f"F.adaptive_avg_pool{k}d", x._grid, lambda: K.adaptive_avg_pool(_plain(x), x._grid, extents, size))
    with_indices = bool(a["return_indices"]) or "with_indices" in getattr(func, "__name__", "")
    return _run(f"F.adaptive_max_pool{k}d", x._grid, lambda: K.adaptive_max_pool(_plain(x), x._grid, extents, size,
                                                                         return_indices=with_indices))


# -- registration: one handler per op family, for each number of spatial dimensions -------------------------------
for _k in (1, 2, 3):
    _handles(*_resolve(f"conv{_k}d"), signature=_conv, windows=_conv_windows)(_convolution)
    _handles(*_resolve(f"conv_transpose{_k}d"), signature=_conv_transpose,
             windows=_transposed_windows)(partial(_transposed, k=_k))
    _max_windows, _avg_windows = _pool_windows(_k, "max"), _pool_windows(_k, "avg")  # one each, made here
    _handles(*_resolve(f"max_pool{_k}d _max_pool{_k}d"), signature=_max_pool,
             windows=_max_windows)(partial(_pool, k=_k, kind="max", windows_of=_max_windows))
    _handles(*_resolve(f"avg_pool{_k}d"), signature=_avg_pool,
             windows=_avg_windows)(partial(_pool, k=_k, kind="avg", windows_of=_avg_windows))
    _handles(*_resolve(f"adaptive_avg_pool{_k}d"), signature=_adaptive)(partial(_adaptive_pool, k=_k, kind="avg"))
    _handles(*_resolve(f"adaptive_max_pool{_k}d adaptive_max_pool{_k}d_with_indices _adaptive_max_pool{_k}d"),
             signature=_adaptive)(partial(_adaptive_pool, k=_k, kind="max"))
