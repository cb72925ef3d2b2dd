"""Adjoint multigrid: the backward pass as the same FAS solve run backwards through the layers.

Back-propagation through Eq. (1) is the linear recursion, backwards in the layer index,

    lambda_N = dL/du_N,   lambda_n = lambda_{n+1} + h_n (dF_n/du at u_n)^T lambda_{n+1},

followed by ``dL/dtheta_n = h_n (dF_n/dtheta at u_n)^T lambda_{n+1}`` (independent across n: one batched call)
and ``dL/du_0 = lambda_0``.  The recursion is a chain of one-step maps like the forward one, so the same
hierarchy and FAS cycles solve it in parallel (Guenther et al., "Layer-parallel training of deep residual
neural networks", section 3, on which Kirby et al. build): the coarse adjoint step is the transpose of the
coarse forward step u + H F(u; theta_{kc}) linearised at the C-point state u_{kc}.  Solved exactly, it equals
serial back-propagation through the states the forward solve produced.

Adjoint time runs backwards: adjoint step k of a level is forward step n_l - 1 - k of that level, and the rank
chain is reversed (the last rank starts).
"""

from __future__ import annotations

import torch

from lightning_hpc.multigrid.hierarchy import Hierarchy
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.steps import StepStack

__all__ = ["AdjointPropagator", "parameter_gradients"]


class AdjointPropagator:
    """``prop(level, steps, lam)`` for the adjoint recursion linearised at the forward states ``states``
    (``[n + 1, *state]``, local point j = state feeding local layer j)."""

    def __init__(self, stack: StepStack, hierarchy: Hierarchy, states: torch.Tensor) -> None:
        self.stack, self.hierarchy, self.states = stack, hierarchy, states

    def __call__(self, level: int, steps: slice, lam: torch.Tensor) -> torch.Tensor:
        n_level = self.hierarchy.sizes[level]
        ks = range(n_level)[steps]
        stride = steps.step or 1
        forward_steps = slice(
            n_level - 1 - ks[-1], n_level - ks[0], stride
        )  # ascending: tensors have no negative strides
        layers = self.hierarchy.layer_slice(level, forward_steps)
        out = self.stack.adjoint_step(
            layers, self.hierarchy.step_sizes[level][forward_steps], self.states[layers], lam.flip(0)
        )
        return out.flip(0)

    def gathered(self, chain: LayerChain) -> AdjointPropagator:
        """The adjoint of the coarsest level of every rank as one level: the C-layers' weights and the forward
        states they are linearised at, gathered in layer order (collective)."""
        layers = self.hierarchy.coarsest_layers()
        states = torch.cat(chain.all_gather(self.states[layers], forward_order=True))
        return AdjointPropagator(
            self.stack.gathered(layers, chain), self.hierarchy.gathered_coarsest(chain, self.stack.device), states
        )


def parameter_gradients(stack: StepStack, states: torch.Tensor, lam: torch.Tensor) -> dict[str, torch.Tensor]:
    """dL/dtheta_n for every local layer, stacked by parameter name; ``lam`` is the adjoint solution in adjoint
    order (``lam[i]`` = lambda at local point n - i)."""
    n = len(stack)
    lam_next = lam[:n].flip(0)  # lambda_{j+1} for local layer j
    return stack.param_grads(slice(0, n, 1), stack.h, states[:n], lam_next)
