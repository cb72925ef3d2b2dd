"""Relaxation sweeps and residuals on one level of the hierarchy (paper Fig. 3 and Eq. 19).

A level holds the points ``u[0..n]`` of this rank (``u[0]`` is the state at the start of the rank's range:
the initial condition on the first rank, a copy of the previous rank's last point elsewhere) and the
right-hand side ``g`` of ``u[k+1] - Phi_k(u[k]) = g[k+1]`` (zero on the fine level: Eq. 18; the FAS
right-hand side S_H on coarse levels: Eq. 24).  Points k c are C-points, the others F-points.

* F-relaxation: from every C-point, propagate through the F-points of its block (all blocks at once).
* C-relaxation: update every C-point from the last F-point of the preceding block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.propagator import Propagator

__all__ = ["Level", "f_relax", "c_relax", "relax", "c_point_residual", "sequential_solve"]


@dataclass
class Level:
    index: int
    u: torch.Tensor  # [n + 1, *state]
    g: torch.Tensor | None  # [n + 1, *state] or None (= 0)

    @property
    def n(self) -> int:
        return self.u.shape[0] - 1


def _apply(prop: Propagator, lv: Level, steps: slice, x: torch.Tensor, rhs: slice) -> torch.Tensor:
    y = prop(lv.index, steps, x)
    return y if lv.g is None else y + lv.g[rhs]


def f_relax(prop: Propagator, lv: Level, c: int, chain: LayerChain) -> None:
    """F-relaxation; first refreshes u[0] from the previous rank (the only point it needs from outside)."""
    chain.exchange(lv.u[lv.n], lv.u[0])
    n = lv.n
    for j in range(c - 1):  # j-th F-point of every block, all blocks in one batched call
        lv.u[j + 1 :: c] = _apply(prop, lv, slice(j, n, c), lv.u[j:n:c], slice(j + 1, n + 1, c))


def c_relax(prop: Propagator, lv: Level, c: int) -> None:
    """C-relaxation: every C-point k c (k >= 1) from the F-point k c - 1 (all local)."""
    n = lv.n
    lv.u[c::c] = _apply(prop, lv, slice(c - 1, n, c), lv.u[c - 1 : n : c], slice(c, n + 1, c))


def relax(prop: Propagator, lv: Level, c: int, chain: LayerChain, kind: str) -> None:
    """"F" or "FCF" relaxation."""
    f_relax(prop, lv, c, chain)
    if kind == "FCF":
        c_relax(prop, lv, c)
        f_relax(prop, lv, c, chain)


def c_point_residual(prop: Propagator, lv: Level, c: int) -> torch.Tensor:
    """R at the C-points 1..n/c: g + Phi(u[k c - 1]) - u[k c] (Eq. 19); zero at F-points after F-relaxation."""
    n = lv.n
    return _apply(prop, lv, slice(c - 1, n, c), lv.u[c - 1 : n : c], slice(c, n + 1, c)) - lv.u[c::c]


def sequential_solve(prop: Propagator, lv: Level, chain: LayerChain) -> None:
    """Exact solve by propagation, rank after rank (the coarsest level; with one level: the serial network,
    i.e. the partitioned-model evaluation)."""
    chain.recv_prev(lv.u[0])
    for k in range(lv.n):
        lv.u[k + 1 : k + 2] = _apply(prop, lv, slice(k, k + 1, 1), lv.u[k : k + 1], slice(k + 1, k + 2, 1))
    chain.send_next(lv.u[lv.n])
