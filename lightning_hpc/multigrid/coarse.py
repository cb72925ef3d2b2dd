"""The exact solve of the coarsest level, in parallel (rank after rank) or gathered where small.

Issue: "the coarse level is solved in parallel or gathered where small".  On the coarsest level the FAS
problem ``u[k+1] = Phi_H,k(u[k]) + g[k+1]`` (Eq. 24/25) is solved exactly by propagation:

* ``sequential``: each rank propagates through its own coarse steps after receiving its first point from the
  previous rank (P - 1 latency hops, the ranks idle in turn; no weights move);
* ``gathered``: every rank gathers the coarsest level (points, right-hand sides, the coarsest C-layers'
  weights, and for the adjoint the forward states they are linearised at), propagates through all of it,
  and keeps its own slice (the "scatter back" costs nothing: every rank computed the result).  One
  all-gather per coarse solve instead of a chain of P - 1 messages; the compute is the same N / c^(L-1)
  coarse steps, so it pays where the coarsest level is small and the latency large.  The weights and states
  are gathered once per forward / adjoint solve, not per cycle.

Both give the same numbers: the same steps are evaluated on the same values (tested bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.propagator import Propagator
from lightning_hpc.multigrid.relaxation import Level, sequential_solve

__all__ = ["GatheredCoarseSolve", "coarse_solver"]

CoarseSolve = Callable[[Level], None]


class GatheredCoarseSolve:
    """Gather the coarsest level onto every rank of ``chain``, solve it serially there, keep the own slice."""

    def __init__(self, prop: Propagator, chain: LayerChain) -> None:
        self.prop, self.chain = prop, chain
        self._global: Propagator | None = None

    def __call__(self, lv: Level) -> None:
        if self._global is None:  # weights (and adjoint linearisation states) fixed during one solve
            self._global = self.prop.gathered(self.chain)
        assert lv.g is not None
        m = lv.n
        parts = self.chain.all_gather(torch.stack([lv.u, lv.g]))  # chain order: the order of the solve
        u = torch.cat([parts[0][0][:1]] + [p[0][1:] for p in parts])  # initial point: the chain's first rank's
        g = torch.cat([parts[0][1][:1]] + [p[1][1:] for p in parts])
        for k in range(u.shape[0] - 1):
            u[k + 1 : k + 2] = self._global(0, slice(k, k + 1, 1), u[k : k + 1]) + g[k + 1 : k + 2]
        i = self.chain.index
        lv.u.copy_(u[i * m : (i + 1) * m + 1])


def coarse_solver(prop: Propagator, chain: LayerChain, gather_threshold: int) -> CoarseSolve:
    """``gathered`` when the coarsest level has at most ``gather_threshold`` steps over all ranks (and there
    is more than one rank), else ``sequential``."""
    top = prop.hierarchy.levels - 1
    if chain.size > 1 and prop.hierarchy.sizes[top] * chain.size <= gather_threshold:
        return GatheredCoarseSolve(prop, chain)
    return lambda lv: sequential_solve(prop, lv, chain)
