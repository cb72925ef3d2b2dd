"""The forward step operators of every level, in the form the FAS solver calls them.

A propagator is called as ``prop(level, steps, x)``: apply the level-``level`` steps ``steps`` (a slice of
step indices of that level, local to this rank) to the states ``x`` (one per step, stacked), returning the
next states.  Fine level: ``u + h F(u; theta_n)`` (Eq. 1); level l: ``u + H F(u; theta_{k c^l})`` with
H = c^l h (Eq. 25): the coarse operator re-uses the C-layers' weights.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_hpc.multigrid.hierarchy import Hierarchy
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.steps import StepStack

__all__ = ["Propagator", "ForwardPropagator"]


class Propagator(Protocol):
    hierarchy: Hierarchy

    def __call__(self, level: int, steps: slice, x: torch.Tensor, /) -> torch.Tensor: ...  # the adjoint names x lam

    def gathered(self, chain: LayerChain) -> Propagator:
        """The same operator on the coarsest level of every rank of ``chain`` as one level (collective)."""
        ...


class ForwardPropagator:
    """Forward Euler steps of the network on every level of ``hierarchy``."""

    def __init__(self, stack: StepStack, hierarchy: Hierarchy) -> None:
        self.stack, self.hierarchy = stack, hierarchy

    def __call__(self, level: int, steps: slice, x: torch.Tensor) -> torch.Tensor:
        return self.stack.step(self.hierarchy.layer_slice(level, steps), self.hierarchy.step_sizes[level][steps], x)

    def gathered(self, chain: LayerChain) -> ForwardPropagator:
        return ForwardPropagator(
            self.stack.gathered(self.hierarchy.coarsest_layers(), chain),
            self.hierarchy.gathered_coarsest(chain, self.stack.device),
        )
