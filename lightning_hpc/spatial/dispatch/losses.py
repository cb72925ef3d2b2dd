"""The losses (``cross_entropy``, ``nll_loss``, ``binary_cross_entropy[_with_logits]``, ``mse_loss``,
``l1_loss``, ``smooth_l1_loss``, ``huber_loss``) with ``reduction="mean"``/``"sum"``: summed over the spatial
group and divided by the global count (or the global weight of the valid targets), so an unchanged mean loss
equals one process's loss.  ``reduction="none"`` stays split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.autograd import _replicated_operand, _tile_of
from lightning_hpc.spatial.dispatch.registry import _handles
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _plain, dims_without
from lightning_hpc.spatial.layout.collectives import all_reduce_replicated

_LOSSES = ("cross_entropy nll_loss binary_cross_entropy_with_logits binary_cross_entropy mse_loss l1_loss "
           "smooth_l1_loss huber_loss").split()


# the functionals only (their Python signatures name every argument); torch's builtins of the same name take the
# reduction as an enum and are left to the gather path
@_handles(*(getattr(F, name) for name in _LOSSES))
def _loss(func, a, args, kwargs):
    if not isinstance(a["input"], SpatialTensor):
        return NotImplemented
    inp, target, red = a.pop("input"), a.pop("target"), a.pop("reduction")
    # the legacy size_average / reduce arguments override the reduction: gathered, as the serial op reads them
    if a.pop("size_average", None) is not None or a.pop("reduce", None) is not None or \
            red not in ("mean", "sum", "none"):
        return NotImplemented
    class_dim_dropped = func.__name__ in ("cross_entropy", "nll_loss") and isinstance(target, torch.Tensor) and \
        not target.is_floating_point()
    # targets laid out like the output of the per-element loss
    if class_dim_dropped:
        if min(inp._sdims) < 1 or 1 in inp._sdims:
            return NotImplemented
        out_ndim, sdims = inp.dim() - 1, dims_without(inp._sdims, [1])
    else:
        out_ndim, sdims = inp.dim(), inp._sdims
    tgt_local = _as_tile(target, inp, out_ndim, sdims)
    if tgt_local is None or any(isinstance(v, SpatialTensor) for v in a.values()):
        return NotImplemented
    rest = {k: _replicated_operand(v, inp._grid) if isinstance(v, nn.Parameter) else v for k, v in a.items()}
    if red == "none":
        out = func(_plain(inp), tgt_local, reduction="none", **rest)
        g = list(inp._gshape)
        if class_dim_dropped:
            del g[1]
        return SpatialTensor.wrap(out, inp._grid, g, sdims, fresh=True)
    local_sum = func(_plain(inp), tgt_local, reduction="sum", **rest)
    total = all_reduce_replicated(local_sum, inp._grid.group)
    if red == "sum":
        return total
    if not class_dim_dropped:
        # every element counts: the global count follows from the global shape (no second all-reduce)
        count = math.prod(inp._gshape)
        if func.__name__ == "cross_entropy":  # class probabilities as the target: the mean is over N x spatial
            count //= inp._gshape[1]
        return total / count
    weight, ignore = a["weight"], a["ignore_index"]
    if a.get("label_smoothing") and weight is not None:
        return NotImplemented
    valid = tgt_local != ignore
    if weight is not None:
        den = (weight.detach()[tgt_local.clamp(min=0) * valid] * valid).sum().double()
    else:
        den = valid.sum().double()
    den = den.reshape(1).to(local_sum.device)
    if inp._grid.group is not None:
        den = all_reduce_replicated(den, inp._grid.group)  # no gradient: the count of the targets
    return total / den.to(total.dtype)[0]


def _as_tile(t, ref: SpatialTensor, ndim: int, sdims: tuple[int, ...]):
    """This tile of a loss target (split like the loss's per-element output, along ``sdims``), or None. A whole
    target that needs a gradient (a teacher's output, a learned target) gets the whole gradient on every rank."""
    if isinstance(t, SpatialTensor):
        if t.dim() != ndim or t._sdims != sdims or t._grid is not ref._grid:
            return None
        return _plain(t)
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() == ndim and [t.shape[d] for d in sdims] == [ref._gshape[d] for d in ref._sdims]:
        return _tile_of(t, ref._grid, sdims)
    return None
