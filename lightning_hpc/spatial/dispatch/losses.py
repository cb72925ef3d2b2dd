"""The losses (``cross_entropy``, ``nll_loss``, ``binary_cross_entropy[_with_logits]``, ``mse_loss``,
``l1_loss``, ``smooth_l1_loss``, ``huber_loss``) with ``reduction="mean"``/``"sum"``: summed over the spatial
group and divided by the global count (or the global weight of the valid targets), so an unchanged mean loss
equals one process's loss.  ``reduction="none"`` stays split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.spatial.collectives import all_reduce_replicated
from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _tile_index
from lightning_hpc.spatial.dispatch.registry import _handles, _resolve
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, _spatials, dims_without


@_handles(*_resolve("cross_entropy nll_loss binary_cross_entropy_with_logits binary_cross_entropy mse_loss l1_loss "
                    "smooth_l1_loss huber_loss"))
def _loss(func, args, kwargs):
    name = func.__name__
    spatial = _spatials(args, kwargs)
    ref = spatial[0]
    inp = args[0] if args else kwargs["input"]
    target = args[1] if len(args) > 1 else kwargs["target"]
    if not isinstance(inp, SpatialTensor):
        return NotImplemented
    kw = dict(kwargs)
    args = list(args)
    if name == "huber_loss":
        red = args[2] if len(args) > 2 else kw.get("reduction", "mean")
        legacy_set = False
    else:
        legacy = (2, 3) if name in ("mse_loss", "l1_loss", "smooth_l1_loss") else (3, 4)
        if name in ("cross_entropy", "nll_loss"):
            legacy = (3, 5)
        legacy_set = any((args[p] if len(args) > p else kw.get(k)) is not None
                         for p, k in zip(legacy, ("size_average", "reduce")))
        rpos = 6 if name in ("cross_entropy", "nll_loss") else (5 if name.startswith("binary") else 4)
        red = args[rpos] if len(args) > rpos else kw.get("reduction", "mean")
        if len(args) > rpos:
            args = args[:rpos]
    if legacy_set or red not in ("mean", "sum", "none"):
        return NotImplemented
    kw.pop("reduction", None)
    class_dim_dropped = name in ("cross_entropy", "nll_loss") and isinstance(target, torch.Tensor) and \
        not target.is_floating_point()
    # targets laid out like the output of the per-element loss
    if class_dim_dropped:
        if min(inp._sdims) < 1 or 1 in inp._sdims:
            return NotImplemented
        out_ndim, sdims = inp.dim() - 1, dims_without(inp._sdims, [1])
    else:
        out_ndim, sdims = inp.dim(), inp._sdims
    tgt_local = _as_tile(target, ref, out_ndim, sdims)
    if tgt_local is None:
        return NotImplemented
    largs = [_plain(inp), tgt_local] + [(_replicated_operand(a, ref._grid) if isinstance(a, nn.Parameter) else a)
                                        for a in args[2:]]
    if any(isinstance(a, SpatialTensor) for a in largs[2:]) or any(isinstance(v, SpatialTensor) for v in kw.values()):
        return NotImplemented
    if red == "none":
        out = func(*largs, reduction="none", **kw)
        g = list(inp._gshape)
        if class_dim_dropped:
            del g[1]
        return SpatialTensor.wrap(out, ref._grid, g, sdims, fresh=True)
    local_sum = func(*largs, reduction="sum", **kw)
    total = all_reduce_replicated(local_sum, ref._grid.group)
    if red == "sum":
        return total
    if class_dim_dropped:
        weight = args[2] if len(args) > 2 else kw.get("weight")
        ignore = args[4] if len(args) > 4 else kw.get("ignore_index", -100)
        smoothing = kw.get("label_smoothing", args[7] if len(args) > 7 else 0.0)
        if smoothing and weight is not None:
            return NotImplemented
        valid = tgt_local != ignore
        if weight is not None:
            den = (weight.detach()[tgt_local.clamp(min=0) * valid] * valid).sum().double()
        else:
            den = valid.sum().double()
    else:
        # every element counts: the global count follows from the global shape (no second all-reduce)
        count = math.prod(inp._gshape)
        if name == "cross_entropy":  # class probabilities as the target: the mean is over N x spatial
            count //= inp._gshape[1]
        return total / count
    den = den.reshape(1).to(local_sum.device)
    if ref._grid.group is not None:
        dist.all_reduce(den, group=ref._grid.group)
    return total / den.to(total.dtype)[0]


def _as_tile(t, ref: SpatialTensor, ndim: int, sdims: tuple[int, ...]):
    """This tile of a loss target (split like the loss's per-element output, along ``sdims``), or None."""
    if isinstance(t, SpatialTensor):
        if t.dim() != ndim or t._sdims != sdims or t._grid is not ref._grid:
            return None
        return _plain(t)
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() == ndim and [t.shape[d] for d in sdims] == [ref._gshape[d] for d in ref._sdims]:
        return t[_tile_index(t.shape, sdims, ref._grid)]
    return None
