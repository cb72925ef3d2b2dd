"""Nonlinear multigrid (FAS / MGRIT) over the layers: Algorithm 1 of Kirby et al., recursively multilevel.

One cycle on level l (``fas_cycle``):

1. relaxation (F or FCF) of L_h(U, theta) = f_h;
2. residual R_h at the C-points and restriction by injection: U_H^k = U_h^{kc}, R_H^k = R_h^{kc};
3. coarse problem L_H(V_H) = L_H(U_H) + R_H =: S_H (Eq. 24) with step H = c h and the C-layers' weights,
   solved exactly (sequential propagation) on the coarsest level, by one cycle of the same kind otherwise;
4./5. fine C-points take the coarse solution, u^{kc} <- u^{kc} + (V_H^k - U_H^k) = V_H^k, then F-relaxation
   brings the F-points in line;
6. the norm ||R_h|| (fine level) decides convergence.

The same code solves the adjoint equations (adjoint.py): only the propagator and the direction of the rank
chain change.
"""

from __future__ import annotations

import math

import torch

from lightning_hpc.multigrid.coarse import CoarseSolve, coarse_solver
from lightning_hpc.multigrid.options import SolveSettings
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.propagator import Propagator
from lightning_hpc.multigrid.relaxation import (
    Level,
    c_point_residual,
    c_relax,
    f_relax,
    relax,
    sequential_solve,
)

__all__ = ["fas_cycle", "mgrit_solve", "make_levels"]


def make_levels(u: torch.Tensor, cfactor: int, levels: int) -> list[Level]:
    """Workspaces of every level for the fine points ``u`` (``[n + 1, *state]``)."""
    n = u.shape[0] - 1
    out = [Level(0, u, None)]
    for level in range(1, levels):
        m = n // cfactor**level
        out.append(
            Level(
                level,
                torch.empty((m + 1, *u.shape[1:]), dtype=u.dtype, device=u.device),
                torch.zeros((m + 1, *u.shape[1:]), dtype=u.dtype, device=u.device),
            )
        )
    return out


def fas_cycle(
    prop: Propagator,
    ws: list[Level],
    level: int,
    chain: LayerChain,
    relaxation: str,
    tol: float | None = None,
    relaxed: bool = False,
    final_relax: bool = True,
    coarse_solve: CoarseSolve | None = None,
) -> float | None:
    """One FAS V-cycle from ``level`` down; returns ||R_h|| (fine level only, measured after relaxation).

    With ``tol`` set and the residual already below it, the cycle stops after the relaxation.
    ``relaxed``: the points are already F-relaxed (the previous cycle ended with F-relaxation and nothing changed
    since), so the leading F-sweep is skipped (it would recompute the same values).  ``final_relax=False``
    skips the closing F-relaxation when only the C-points (e.g. the output u_N) are wanted.  ``coarse_solve``
    solves the coarsest level (coarse.py; default: propagation rank after rank).
    """
    c = prop.hierarchy.cfactor
    lv, coarse = ws[level], ws[level + 1]
    if not relaxed:
        relax(prop, lv, c, chain, relaxation)
    elif relaxation == "FCF":
        c_relax(prop, lv, c)
        f_relax(prop, lv, c, chain)
    r = c_point_residual(prop, lv, c)
    norm = None
    if level == 0:
        norm = math.sqrt(float(chain.sum(r.detach().to(torch.float64).pow(2).sum())))
        if tol is not None and norm <= tol:
            return norm
    n_coarse = coarse.n
    assert coarse.g is not None  # every coarse level carries its right-hand side (workspaces)
    coarse.u.copy_(lv.u[:: c])  # injection of the states, ghost point included
    # S_H = L_H(U_H) + R_H at the coarse points 1..n/c (Eq. 24): g_H = R + U_H - Phi_H(U_H^{k-1})
    coarse.g[1:] = r + lv.u[c::c] - prop(level + 1, slice(0, n_coarse, 1), lv.u[0 : lv.n : c])
    if level + 1 == len(ws) - 1:
        if coarse_solve is None:
            sequential_solve(prop, coarse, chain)
        else:
            coarse_solve(coarse)
    else:
        fas_cycle(prop, ws, level + 1, chain, relaxation, coarse_solve=coarse_solve)
    lv.u[c::c] = coarse.u[1:]  # u^{kc} <- u^{kc} + delta u_H^k (Algorithm 1, steps 4-5)
    lv.u[0] = coarse.u[0]
    if final_relax:
        f_relax(prop, lv, c, chain)
    return norm


def mgrit_solve(
    prop: Propagator,
    u: torch.Tensor,
    relaxation: str,
    settings: SolveSettings,
    chain: LayerChain,
    need_all_points: bool = True,
    coarse_gather_threshold: int = 0,
) -> list[float]:
    """Solve the chain of steps in place in ``u`` (initial guess in, solution out); returns ||R_h|| per cycle.

    With one level, the steps are propagated sequentially (exact; no cycles, empty history).  With
    ``need_all_points=False`` (inference: only u_N, a C-point, is read) the last cycle's closing F-relaxation is
    skipped, so the F-points of the result are stale.  The coarsest level is gathered onto every rank when it
    has at most ``coarse_gather_threshold`` steps in all (coarse.py).
    """
    hierarchy = prop.hierarchy
    ws = make_levels(u, hierarchy.cfactor, hierarchy.levels)
    if hierarchy.levels == 1:
        sequential_solve(prop, ws[0], chain)
        return []
    history: list[float] = []
    coarse_solve = coarse_solver(prop, chain, coarse_gather_threshold)
    for cycle in range(settings.cycles):
        last = cycle == settings.cycles - 1
        norm = fas_cycle(
            prop,
            ws,
            0,
            chain,
            relaxation,
            settings.tol,
            relaxed=cycle > 0,
            final_relax=need_all_points or not last,
            coarse_solve=coarse_solve,
        )
        assert norm is not None
        history.append(norm)
        if settings.tol is not None and norm <= settings.tol:
            break
    return history
