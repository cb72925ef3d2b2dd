"""Normalisation layers on tiles (the kernels: :mod:`~lightning_hpc.spatial.kernels.normalization`): ``F.batch_norm``
(statistics over the whole sample), ``F.group_norm``/``F.instance_norm``/``F.layer_norm`` over the split
dimensions (statistics over the whole sample, in the dtype the serial op returns), and ``F.layer_norm`` over
unsplit dimensions (local).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _replicated_operands, _tile_index
from lightning_hpc.spatial.dispatch.registry import _handles
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _fresh, _plain, _wrap_like
from lightning_hpc.spatial.kernels.normalization import aggregated_batch_norm, aggregated_row_norm


@_handles(F.layer_norm)
def _layer_norm(func, a, args, kwargs):
    if not isinstance(a["input"], SpatialTensor) or _split_operand(a, "weight", "bias"):
        return NotImplemented
    x, shape, w, b, eps = a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    d0 = x.dim() - len(shape)
    inside = [d >= d0 for d in x.split_dims]
    if any(inside) and not all(inside) or tuple(x._gshape[d0:]) != shape:
        return NotImplemented  # split dims both normalised and not, or a wrong shape: gathered (the serial error)
    w, b = _replicated_operands(x._grid, w, b)
    if not any(inside) or x._grid.group is None:
        return _wrap_like(F.layer_norm(_plain(x), shape, w, b, eps), x)
    # over split dimensions (LayerNorm([C, H, W])): statistics per leading index over the whole sample, and the
    # element-wise affine parameters cut to this tile (their gradients are tile parts, summed by the strategy)
    idx = _tile_index(x._gshape, x._sdims, x._grid)[d0:]
    w, b = (None if t is None else t[idx] for t in (w, b))
    local = _plain(x)
    return _row_norm("layer", x, local, math.prod(local.shape[:d0]), w, b, None, eps)[0]


_NORM_DTYPES: dict[tuple, torch.dtype] = {}


def _serial_norm_dtype(kind: str, x: torch.Tensor, w, b) -> torch.dtype:
    """The dtype the serial ``F.group_norm`` / ``F.instance_norm`` / ``F.layer_norm`` returns for these operand
    dtypes under the current autocast state of ``x``'s device (float32 for a bf16 input on some devices, the
    input's dtype on others): found once per combination on a tiny input on the same device."""
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    key = (kind, dev, x.dtype, None if w is None else w.dtype, None if b is None else b.dtype, autocast,
           torch.get_autocast_dtype(dev) if autocast else None)
    dtype = _NORM_DTYPES.get(key)
    if dtype is None:
        shape = (2, 2, 2) if kind == "layer" else (2,)
        pw, pb = (None if t is None else torch.ones(shape, dtype=t.dtype, device=x.device) for t in (w, b))
        with torch.no_grad():
            probe = torch.arange(8, dtype=x.dtype, device=x.device).reshape(1, 2, 2, 2)
            if kind == "group":
                out = F.group_norm(probe, 1, pw, pb)
            elif kind == "instance":
                out = F.instance_norm(probe, None, None, pw, pb)
            else:
                out = F.layer_norm(probe, shape, pw, pb)
        dtype = _NORM_DTYPES[key] = out.dtype
    return dtype


def _row_norm(kind: str, x: SpatialTensor, local: torch.Tensor, rows: int, w, b, view, eps: float):
    """``F.{kind}_norm`` of the tile ``local`` of ``x`` viewed as ``rows`` rows, each normalised with the statistics
    of the whole row over the spatial group, then the affine parameters (shaped by ``view``), in the dtype the
    serial op returns.  Also returns the float64 per-row mean and biased variance."""
    out_dtype = _serial_norm_dtype(kind, local, w, b)
    # computed in float32 (float64 when the input or the result is float64): the serial kernels accumulate
    # reduced-precision inputs in float32 too
    cdt = torch.float64 if torch.float64 in (local.dtype, out_dtype) else torch.float32
    y, mean64, var64 = aggregated_row_norm(local.to(cdt).reshape(rows, -1), eps, x._grid.group)
    return _wrap_like(_affine(y.reshape(local.shape), w, b, view, cdt).to(out_dtype), x), mean64, var64


def _update_running(rm, rv, mean: torch.Tensor, unbiased: torch.Tensor, momentum: float) -> None:
    """The serial layer's update of its running statistics by the batch's mean and unbiased variance."""
    with torch.no_grad():
        if rm is not None:
            rm.mul_(1 - momentum).add_(mean.to(rm.dtype), alpha=momentum)
        if rv is not None:
            rv.mul_(1 - momentum).add_(unbiased.to(rv.dtype), alpha=momentum)


def _affine(y: torch.Tensor, w, b, view, dtype: torch.dtype) -> torch.Tensor:
    if w is not None:
        w = w.to(dtype)
        y = y * (w.view(view) if view is not None else w)
    if b is not None:
        b = b.to(dtype)
        y = y + (b.view(view) if view is not None else b)
    return y


def _norm_over_space(x) -> bool:
    """N x C x spatial... with the split dimensions among the spatial ones (statistics over them)."""
    # (``type(x) is`` first and the number of dimensions from the global shape: no call for the usual input)
    return (type(x) is SpatialTensor or isinstance(x, SpatialTensor)) and len(x._gshape) >= 3 and min(x._sdims) >= 2


#: the types of a layer's own parameters and buffers, which are not split tensors (no ``isinstance`` per operand)
_PLAIN = frozenset({torch.Tensor, nn.Parameter, type(None)})


def _split_operand(a: dict, *names: str) -> bool:
    """A parameter or running statistic given as a split tensor: no tiled form (gathered)."""
    for k in names:
        v = a[k]
        if type(v) not in _PLAIN and isinstance(v, SpatialTensor):
            return True
    return False


@_handles(F.group_norm)
def _group_norm(func, a, args, kwargs):
    if not _norm_over_space(a["input"]) or _split_operand(a, "weight", "bias"):
        return NotImplemented
    x, groups, w, b, eps = a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"]
    if x._gshape[1] % groups:
        return NotImplemented
    w, b = _replicated_operands(x._grid, w, b)
    local = _plain(x)
    if not x.split_dims or x._grid.group is None:
        return _wrap_like(F.group_norm(local, groups, w, b, eps), x)
    view = (1, -1) + (1,) * (x.dim() - 2)
    return _row_norm("group", x, local, local.shape[0] * groups, w, b, view, eps)[0]


@_handles(F.instance_norm)
def _instance_norm(func, a, args, kwargs):
    if not _norm_over_space(a["input"]) or _split_operand(a, "running_mean", "running_var", "weight", "bias"):
        return NotImplemented
    x, rm, rv, w, b = a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"]
    use_input_stats, momentum, eps = a["use_input_stats"], a["momentum"], a["eps"]
    w, b = _replicated_operands(x._grid, w, b)
    local = _plain(x)
    if not use_input_stats or not x.split_dims or x._grid.group is None:  # running statistics: per element
        return _wrap_like(F.instance_norm(local, rm, rv, w, b, use_input_stats, momentum, eps), x)
    n, c = local.shape[:2]
    view = (1, -1) + (1,) * (x.dim() - 2)
    out, mean64, var64 = _row_norm("instance", x, local, n * c, w, b, view, eps)
    if rm is not None or rv is not None:
        # as the serial op: each instance's statistics update the running ones with the momentum, averaged over
        # the batch (the variance unbiased over the whole spatial extent)
        count = math.prod(x._gshape[2:])
        unbiased = var64 * (count / max(count - 1.0, 1.0))
        _update_running(rm, rv, mean64.view(n, c).mean(0), unbiased.view(n, c).mean(0), momentum)
    return out


@_handles(F.batch_norm)
def _batch_norm(func, a, args, kwargs):
    if not _norm_over_space(a["input"]) or _split_operand(a, "running_mean", "running_var", "weight", "bias"):
        return NotImplemented
    x, rm, rv, weight, bias = a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"]
    training, momentum, eps = a["training"], a["momentum"], a["eps"]
    grid, gshape = x._grid, x._gshape
    # F.batch_norm's own checks, against the global shape (the split call returned to the dispatch before them), so
    # that one tile runs torch.batch_norm itself: every batch norm's per-call path, and its operands inline below
    if training:
        if gshape[0] * math.prod(gshape[2:]) == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {torch.Size(gshape)}")
        if eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif eps < 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    if weight is not None:
        weight = _replicated_operand(weight, grid)
    if bias is not None:
        bias = _replicated_operand(bias, grid)
    local = _plain(x)
    if not training or grid.group is None:
        y = torch.batch_norm(local, weight, bias, rm, rv, training, momentum, eps, torch.backends.cudnn.enabled)
        return _fresh(y, grid, gshape, x._sdims)
    y, mean64, var64, n = aggregated_batch_norm(local, weight, bias, eps, grid.group)
    if rm is not None and rv is not None:
        _update_running(rm, rv, mean64, var64 * (n / (n - 1.0).clamp_min(1.0)), momentum)  # n: on the device
    return _fresh(y, grid, gshape, x._sdims)
