"""The gather path for ops without a tiled form (flips, rolls, integer indices of split dimensions, views that
merge split dimensions, softmax over positions, ...): the split operands are gathered, the op runs
on the whole activation exactly as on one process, and a result with the same number of dimensions is split
again, with a one-time warning naming the op, the module and the bytes.  With ``on_unsupported="error"`` this
raises instead.  In-place ops that cannot be done on a tile are always refused.
"""

from __future__ import annotations

import warnings

import torch

from lightning_hpc.spatial.dispatch.autograd import _tile_of
from lightning_hpc.spatial.dispatch.calls import _inplace_call, _is_inplace, _op_name
from lightning_hpc.spatial.dispatch.state import _STATE, SpatialDispatchError
from lightning_hpc.spatial.dispatch.state import where as where_of
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _nbytes, _spatials


def _unsupported(func, reason: str, fix: str, spatial: list[SpatialTensor], *, inplace: bool = False) -> None:
    """Refuse, or warn once before gathering."""
    op, where = _op_name(func), where_of(spatial[0]._grid)
    nbytes = sum(_nbytes(t, t._gshape) for t in spatial)
    if inplace or (_STATE.on_unsupported or spatial[0]._grid.policy.on_unsupported) == "error":
        raise SpatialDispatchError(
            f"spatial: {op} in {where} {reason}; it would compute something different on a tile than on the whole "
            f"sample. {fix}"
        )
    key, warned = (op, where), spatial[0]._grid.warned  # once per op and module in each run (grid)
    if key not in warned:
        warned.add(key)
        warnings.warn(
            f"spatial: {op} in {where} {reason}: gathering the whole activation ({nbytes} bytes per rank per call, "
            f"{len(spatial)} all-gather(s)) and computing it exactly as one process does. {fix}",
            stacklevel=3,
        )


def gathered_call(func, args, kwargs, spatial: list[SpatialTensor], *, what: str, reason: str, inplace_fix: str,
                  fix: str):
    """``func`` on the whole tensors: the split operands ``spatial`` gathered (refused first when the call changes
    a split operand in place, or when gathering is off; warned about once otherwise, and counted), the result whole.
    ``what`` names the operands in messages ("a split activation"), ``reason`` says why the op is gathered."""
    # the operand an in-place op changes is its first (a method's self; the input a functional hands on first)
    if (_is_inplace(func) or _inplace_call(kwargs)) and isinstance(args[0], SpatialTensor) or \
            kwargs.get("out") is not None:
        _unsupported(func, f"changes {what} in place in a way that has no tiled form", inplace_fix, spatial,
                     inplace=True)
    _unsupported(func, reason, fix, spatial)
    _STATE.gathers += len(spatial)
    _STATE.gathered_bytes += sum(_nbytes(t, t._gshape) for t in spatial)

    def full_of(a):
        if isinstance(a, SpatialTensor):
            return a.full()
        if isinstance(a, (list, tuple)) and any(isinstance(v, SpatialTensor) for v in a):
            return type(a)(full_of(v) for v in a)
        return a

    return func(*[full_of(a) for a in args], **{k: full_of(v) for k, v in kwargs.items()})


def _fallback(func, args, kwargs):
    spatial = _spatials(args, kwargs)
    if not spatial:
        return func(*args, **kwargs)
    out = gathered_call(
        func, args, kwargs, spatial, what="a split activation", reason="has no tiled form",
        inplace_fix="Write it out of place, so it is computed on the tiles: x = torch.where(cond, value, x) or "
                    "x = x.masked_fill(mask, value) for an edit of some positions (x[mask] = value with a boolean "
                    "mask is done so already), x = F.pad(x[..., 1:, :], (0, 0, 1, 0)) for a zeroed border row, "
                    "torch.cat of the parts otherwise",
        fix="To avoid the gather, use an op with a tiled form (see docs/spatial.md) or pass on_unsupported='error' "
            "to see every such op")
    return _resplit(out, spatial[0])


def _resplit(out, ref: SpatialTensor):
    """Split a result computed on whole activations again when it still has the reference's dimensions."""
    if isinstance(out, torch.Tensor) and not isinstance(out, SpatialTensor):
        if out.dim() == ref.dim() and all(out.shape[d] >= p for d, p in zip(ref._sdims, ref._grid.parts)) and \
                (out.is_floating_point() or not out.requires_grad):
            local = _tile_of(out, ref._grid, ref._sdims)
            return SpatialTensor.wrap(local, ref._grid, tuple(out.shape), ref._sdims, fresh=True)
        return out
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_resplit(o, ref) for o in out)
    return out
