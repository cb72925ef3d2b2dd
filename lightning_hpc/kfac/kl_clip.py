"""The KL clip of Eq 18 (SC20; Ba et al. 2017): the preconditioned gradients are scaled by

    nu = min(1, sqrt(kappa / (sum_i alpha_i^2 |P_i . grad_i|)))

with ``P_i`` layer ``i``'s preconditioned gradient, ``grad_i`` its gradient and ``alpha_i`` its current learning
rate, so that no step moves the model's output distribution by more than about ``kappa`` in KL divergence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from lightning_hpc.kfac.layers import LayerHandler

__all__ = ["kl_clip_factor", "layer_lrs"]


def layer_lrs(lr: float | None, optimizer: torch.optim.Optimizer | None,
              default: float | Callable[[], float] | None) -> Callable[[LayerHandler], float | None]:
    """Each layer's learning rate for Eq 18: ``lr`` when given, else the lr of the first ``optimizer`` parameter
    group holding the layer's weight, else ``default`` (a float or a zero-argument callable; None: none known).
    The groups are indexed once per step: searching them for every layer cost as much as a fifth of a
    preconditioning step."""
    if lr is not None:
        return lambda h: float(lr)
    by_param: dict[int, float] = {}
    for group in optimizer.param_groups if optimizer is not None else ():
        for p in group["params"]:
            by_param.setdefault(id(p), float(group["lr"]))
    fallback = None if default is None else float(default() if callable(default) else default)
    return lambda h: by_param.get(id(h.module.weight), fallback)


def kl_clip_factor(handlers: Sequence[LayerHandler], precond: dict[str, torch.Tensor],
                   grads: dict[str, torch.Tensor], kl_clip: float, lr_of: Callable[[LayerHandler], float | None],
                   has_optimizer: bool,
                   products: Sequence[tuple[list[str], torch.Tensor]] | None = None) -> torch.Tensor | None:
    """``nu`` of Eq 18 for the layers of ``handlers`` in ``precond`` (their preconditioned gradient matrices;
    ``grads``: the raw ones), as a float64 scalar tensor on their device (``None``: no layer to clip, nu = 1).
    ``products``, when given, holds every such layer's ``P_i . grad_i`` already, as vectors over groups of layers
    (:attr:`~lightning_hpc.kfac.batched.PreconditionBuckets.last_kl_terms`: one reduction per bucket); else they are
    formed here, one per layer. They are weighted and summed in float64 on the device: nothing is read back to the
    host (on a GPU the step's last synchronisation, which made the host wait for the whole backward pass and the
    preconditioning before it could go on), and the weights are uploaded only when the learning rates change. A
    layer without a learning rate is refused, naming it."""
    lr_square: dict[str, float] = {}
    for h in handlers:
        if h.name not in precond:
            continue
        layer_lr = lr_of(h)
        if layer_lr is None:
            where = (f": the weight of layer {h.name!r} is in none of the optimizer's parameter groups"
                     if has_optimizer else "")
            raise ValueError(
                f"K-FAC kl_clip needs the learning rate{where}; pass the optimizer that trains every "
                "preconditioned layer as optimizer= (or lr=) to KFACPreconditioner, or lr= to step()"
            )
        lr_square[h.name] = layer_lr**2
    if not lr_square:
        return None
    if products is None:
        products = [([name], (precond[name] * grads[name].to(precond[name].dtype)).sum().reshape(1))
                    for name in lr_square]
    names = [name for group, _ in products for name in group]
    if sorted(names) != sorted(lr_square):
        raise AssertionError(f"K-FAC KL clip: products for {sorted(names)}, layers {sorted(lr_square)}")
    terms = torch.cat([t.reshape(-1) for _, t in products]).to(torch.float64).abs()
    vg_sum = (terms * _weights(tuple(lr_square[name] for name in names), terms.device)).sum()
    # min(1, sqrt(kappa / vg)) for vg > 0, else 1 (a NaN sum included, as a Python comparison would have it)
    return torch.where(vg_sum > 0, torch.sqrt(kl_clip / vg_sum).clamp(max=1.0), torch.ones_like(vg_sum))


@functools.lru_cache(maxsize=8)
def _weights(lr_squares: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The layers' squared learning rates as a float64 tensor on ``device``, made once per distinct set (a
    schedule changes them once per epoch or step; every call with the same ones reuses the upload)."""
    return torch.tensor(lr_squares, dtype=torch.float64).to(device)
