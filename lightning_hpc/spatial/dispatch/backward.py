"""Gradients of split activations seen by user code: a hook registered on a split activation sees the tile's
part of the gradient as a :class:`SpatialTensor`, and ``torch.autograd.grad`` returns gradients split like
their inputs.
"""

from __future__ import annotations

import torch

from lightning_hpc._compat import enable_torch_function
from lightning_hpc.spatial.dispatch.calls import _grad_inputs
from lightning_hpc.spatial.dispatch.registry import _handles
from lightning_hpc.spatial.dispatch.state import SpatialDispatchError, where
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _layout, _plain, _spatials


def _hook_args(input, hook): ...  # noqa: E704  (Tensor.register_hook's, which names its tensor ``self``)


@_handles(torch.Tensor.register_hook, signature=_hook_args)
def _register_hook(func, a, args, kwargs):
    """A gradient hook on a split activation sees the tile's part of the gradient as a :class:`SpatialTensor`, so
    a norm or a mean it takes is global (one process's value), and what it returns replaces the tile's part."""
    t, hook = a["input"], a["hook"]
    if not isinstance(t, SpatialTensor):
        return NotImplemented
    layout = _layout(t)

    def on_tile(grad: torch.Tensor):
        # also when the hook fires inside torch.autograd.grad below, which runs with subclass dispatch off
        with enable_torch_function():
            out = hook(SpatialTensor.wrap(grad, *layout))
        return _plain(out) if isinstance(out, SpatialTensor) else out

    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.register_hook(t, on_tile)


@_handles(torch.autograd.grad)
def _autograd_grad(func, a, args, kwargs):
    """``torch.autograd.grad`` with split activations among the inputs: each gradient is the tile's part of one
    process's gradient, returned split like its input.  Differentiating twice (``create_graph=True``) would
    differentiate the halo exchanges and collectives, whose backward is not itself differentiable: refused."""
    ins = a["inputs"] = _grad_inputs(a["inputs"])
    if a["create_graph"]:
        raise SpatialDispatchError(
            f"spatial: torch.autograd.grad(create_graph=True) in {where(_spatials(args, kwargs)[0]._grid)} "
            f"differentiates through split "
            f"activations twice (a gradient penalty on them); the tile exchanges have no second derivative here. "
            f"Compute the penalty on a gathered tensor (lightning_hpc.spatial.dispatch.gather_tensor), or train this "
            f"module with one tile per sample (spatial_parts=(1, 1), or (1, 1, 1) for volumes) or strategy='ddp'"
        )
    with torch._C.DisableTorchFunctionSubclass():
        grads = torch.autograd.grad(**a)
    return tuple(SpatialTensor.wrap(g, *_layout(i)) if isinstance(i, SpatialTensor) and g is not None else g
                 for g, i in zip(grads, ins))
