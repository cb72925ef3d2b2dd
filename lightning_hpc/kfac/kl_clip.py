"""The KL clip of Eq 18 (SC20; Ba et al. 2017): the preconditioned gradients are scaled by

    nu = min(1, sqrt(kappa / (sum_i alpha_i^2 |P_i . grad_i|)))

with ``P_i`` layer ``i``'s preconditioned gradient, ``grad_i`` its gradient and ``alpha_i`` its current learning
rate, so that no step moves the model's output distribution by more than about ``kappa`` in KL divergence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_hpc.kfac.layers import LayerHandler

__all__ = ["LayerLearningRates", "kl_clip_factor"]


class LayerLearningRates:
    """Each layer's learning rate for Eq 18, squared: the ``lr`` of a step when given, else the lr of the first
    ``optimizer`` parameter group holding the layer's weight, else ``default`` (a float or a zero-argument callable;
    None: none known, and the layer is refused, naming it). Which group holds which layer is looked up once per
    list of layers and layout of the groups (their number and sizes), the rates read from the groups every step,
    and the squares uploaded once per distinct set: a step does no per-layer work for them (searching the groups
    for every layer cost as much as a fifth of a preconditioning step)."""

    def __init__(self) -> None:
        self._index: tuple[Any, ...] | None = None  # (layers, optimizer, layout, group index per layer, names)

    def squares(self, layers: Sequence[LayerHandler], lr: float | None, optimizer: torch.optim.Optimizer | None,
                default: float | Callable[[], float] | None, device: torch.device) -> torch.Tensor:
        """The squared learning rates of ``layers`` as a float64 vector on ``device``."""
        groups = optimizer.param_groups if optimizer is not None else []
        layout = [len(g["params"]) for g in groups]
        index = self._index
        if index is None or index[0] is not layers or index[1] is not optimizer or index[2] != layout:
            first: dict[int, int] = {}
            for i, group in enumerate(groups):
                for p in group["params"]:
                    first.setdefault(id(p), i)
            index = self._index = (layers, optimizer, layout, tuple(first.get(id(h.weight), -1) for h in layers),
                                   tuple(h.name for h in layers))
        fallback = None if default is None else float(default() if callable(default) else default)
        rates = (*(float(g["lr"]) for g in groups), fallback)  # index -1: the fallback
        return _weights(None if lr is None else float(lr), rates, index[3], index[4], optimizer is not None, device)


def kl_clip_factor(products: Sequence[torch.Tensor], lr_squares: torch.Tensor, kl_clip: float) -> torch.Tensor:
    """``nu`` of Eq 18 as a float64 scalar tensor on the products' device, from every clipped layer's
    ``P_i . grad_i`` (``products``: vectors over groups of layers, :attr:`~lightning_hpc.kfac.batched.
    PreconditionBuckets.last_kl_terms`, one reduction per bucket) and their squared learning rates in the same
    order (:meth:`LayerLearningRates.squares`). They are weighted and summed in float64 on the device: nothing is
    read back to the host (on a GPU the step's last synchronisation, which made the host wait for the whole backward
    pass and the preconditioning before it could go on)."""
    terms = torch.cat(list(products)).to(torch.float64).abs()
    if terms.shape != lr_squares.shape:
        raise AssertionError(f"K-FAC KL clip: {terms.numel()} products, {lr_squares.numel()} learning rates")
    vg_sum = (terms * lr_squares).sum()
    # min(1, sqrt(kappa / vg)) for vg > 0, else 1 (a NaN sum included, as a Python comparison would have it)
    return torch.where(vg_sum > 0, torch.sqrt(kl_clip / vg_sum).clamp(max=1.0), torch.ones_like(vg_sum))


@functools.lru_cache(maxsize=8)
def _weights(lr: float | None, rates: tuple[float | None, ...], index: tuple[int, ...], names: tuple[str, ...],
             has_optimizer: bool, device: torch.device) -> torch.Tensor:
    """The layers' squared learning rates as a float64 tensor on ``device``, made once per distinct set (a
    schedule changes them once per epoch or step; every call with the same ones reuses the upload)."""
    squares = []
    for i, name in zip(index, names):
        layer_lr = lr if lr is not None else rates[i]
        if layer_lr is None:
            where = (f": the weight of layer {name!r} is in none of the optimizer's parameter groups"
                     if has_optimizer else "")
            raise ValueError(
                f"K-FAC kl_clip needs the learning rate{where}; pass the optimizer that trains every "
                "preconditioned layer as optimizer= (or lr=) to KFACPreconditioner, or lr= to step()"
            )
        squares.append(layer_lr**2)
    return torch.tensor(squares, dtype=torch.float64).to(device)
