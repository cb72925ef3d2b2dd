"""Batched evaluation of many residual steps at once: stacked weights + ``torch.func.vmap``.

A relaxation sweep applies one step in every layer block (Fig. 3); the blocks are independent, so instead of
one CUDA stream per block (the paper's implementation, section III-D) the branches' weights are stacked along
a leading dimension and ``functional_call`` is vmapped over (weights, state): one batched kernel per layer
type (a grouped convolution for conv branches) evaluates all blocks concurrently, on CPU or GPU.

Batch normalisation inside the branches: while iterating, F uses the batch statistics without touching the
running statistics (each layer is evaluated several times per pass); :meth:`StepStack.update_running_stats`
then updates them once per layer from the final states, as one serial forward pass would.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

if TYPE_CHECKING:
    from lightning_hpc.multigrid.parallel import LayerChain

__all__ = ["StepStack"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _stateless_batch_norm(template: nn.Module) -> nn.Module:
    """Copy of ``template`` whose BN layers always normalise with batch statistics and own no buffers."""
    out = copy.deepcopy(template)
    for m in out.modules():
        if isinstance(m, _BN):
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
            m.track_running_stats = False
    return out


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(submodule, attribute) holding the parameter or buffer ``name`` ("0.weight") of ``module``."""
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _signature(module: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, type(m).__name__, ()) for name, m in module.named_modules()] + [
        (name, "tensor", tuple(t.shape)) for name, t in list(module.named_parameters()) + list(module.named_buffers())
    ]


class StepStack:
    """The residual branches F_0..F_{n-1} of one rank with step sizes h, evaluated in batches.

    All branches must have the same structure (module types, parameter and buffer shapes) so their weights
    stack.  Call :meth:`refresh` before each pass (weights change between optimizer steps).
    """

    def __init__(
        self, branches: Sequence[nn.Module], h: Sequence[float], concurrent: bool = True, first_index: int = 0
    ) -> None:
        self.branches = list(branches)
        if not self.branches:
            raise ValueError("no residual steps to stack")
        ref = _signature(self.branches[0])
        for i, b in enumerate(self.branches[1:], start=1):
            if _signature(b) != ref:
                raise ValueError(
                    f"residual step {first_index + i} has a branch of different structure than step {first_index} "
                    f"({b!r:.80} vs {self.branches[0]!r:.80}): the multigrid solver evaluates the steps with "
                    "stacked weights, so every residual branch of the trunk needs the same layers and shapes"
                )
        self.h = torch.tensor(list(h), dtype=torch.float64)
        self.concurrent = concurrent
        self.param_names = [name for name, _ in self.branches[0].named_parameters()]
        self.buffer_names = [name for name, _ in self.branches[0].named_buffers()]
        self.has_batch_norm = any(isinstance(m, _BN) for m in self.branches[0].modules())
        self._template = copy.deepcopy(self.branches[0]).to("meta")
        self._template_batch_stats = _stateless_batch_norm(self._template)
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.training = True
        # (owning submodule, attribute) of every parameter / buffer per branch: refresh() reads them with
        # getattr instead of walking the module tree each pass (it runs every forward; tensors replaced by
        # .to() or assignment are still picked up)
        self._param_refs = [[_owner(b, k) for k in self.param_names] for b in self.branches]
        self._buffer_refs = [[_owner(b, k) for k in self.buffer_names] for b in self.branches]

    def __len__(self) -> int:
        return len(self.branches)

    def refresh(self, training: bool) -> None:
        """Stack the current weights (detached: gradients come from the adjoint solve, not autograd)."""
        self.training = training
        self._template.train(training)  # eval: BN normalises with the running statistics passed as buffers
        with torch.no_grad():
            self.params = {
                k: torch.stack([getattr(*refs[i]).detach() for refs in self._param_refs])
                for i, k in enumerate(self.param_names)
            }
            self.buffers = {
                k: torch.stack([getattr(*refs[i]) for refs in self._buffer_refs])
                for i, k in enumerate(self.buffer_names)
            }

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")

    def gathered(self, layers: slice, chain: LayerChain) -> StepStack:
        """A stack of the ``layers`` of every rank of ``chain`` in layer order (weights and buffers gathered,
        collective): the operator of the gathered coarsest level (coarse.py).  Evaluation only (no modules)."""
        view = copy.copy(self)
        view.branches = []
        view.params = {k: torch.cat(chain.all_gather(v[layers], forward_order=True)) for k, v in self.params.items()}
        view.buffers = {k: torch.cat(chain.all_gather(v[layers], forward_order=True)) for k, v in self.buffers.items()}
        return view

    # -- one branch, functional --------------------------------------------------------------------------
    def _branch(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], u: torch.Tensor
    ) -> torch.Tensor:
        if self.training and self.has_batch_norm:
            return functional_call(self._template_batch_stats, params, (u,))
        return functional_call(self._template, (params, buffers), (u,))

    def _batched(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], u: torch.Tensor
    ) -> torch.Tensor:
        if self.concurrent and u.shape[0] > 1:  # one step (the coarsest solve): a plain call, no vmap overhead
            return vmap(self._branch)(params, buffers, u)
        return torch.stack(
            [
                self._branch({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in buffers.items()}, u[i])
                for i in range(u.shape[0])
            ]
        )

    def _select(self, layers: slice) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {k: v[layers] for k, v in self.params.items()}, {k: v[layers] for k, v in self.buffers.items()}

    @staticmethod
    def _scale(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return h.to(dtype=like.dtype, device=like.device).view(-1, *([1] * (like.dim() - 1)))

    # -- the three operations the solver needs ---------------------------------------------------------
    def step(self, layers: slice, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``u[i] + h[i] F_{layers[i]}(u[i])`` for every i (forward Euler, Eq. 1 / Eq. 25 with H)."""
        params, buffers = self._select(layers)
        return u + self._scale(h, u) * self._batched(params, buffers, u)

    def adjoint_step(self, layers: slice, h: torch.Tensor, u: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """``lam[i] + h[i] (dF/du at u[i])^T lam[i]``: the transpose of the linearised step, for the adjoint."""
        params, buffers = self._select(layers)
        pullback = vjp(lambda x: self._batched(params, buffers, x), u)[1]  # (output, pullback)
        (g,) = pullback(lam)
        return lam + self._scale(h, lam) * g

    def param_grads(
        self, layers: slice, h: torch.Tensor, u: torch.Tensor, lam_next: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``dL/dtheta_n = h_n (dF/dtheta at u_n)^T lam_{n+1}`` for every selected layer, stacked."""
        params, buffers = self._select(layers)
        pullback = vjp(lambda p: self._batched(p, buffers, u), params)[1]
        (grads,) = pullback(self._scale(h, lam_next) * lam_next)
        return grads

    def update_running_stats(self, u: torch.Tensor) -> None:
        """One BN running-statistics update per layer from the states ``u[n]`` feeding layer n (training)."""
        if not (self.training and self.has_batch_norm):
            return
        with torch.no_grad():
            buffers = {k: v.clone() for k, v in self.buffers.items()}
            template = self._template.train()
            if self.concurrent:
                vmap(lambda p, b, x: functional_call(template, (p, b), (x,)))(self.params, buffers, u)
            else:
                for i in range(u.shape[0]):
                    functional_call(
                        template,
                        ({k: v[i] for k, v in self.params.items()}, {k: v[i] for k, v in buffers.items()}),
                        (u[i],),
                    )
            for i, branch in enumerate(self.branches):
                named = dict(branch.named_buffers())
                for k in self.buffer_names:
                    named[k].copy_(buffers[k][i])
