"""Who decomposes which factor and who preconditions which layer (KAISA, Pauloski et al., SC21,
arXiv:2107.01739): step 2 of Algorithm 1 on the factors' owning ranks with the results shared within each layer's
gradient-worker group, and step 3 by the gradient workers with the results broadcast to their broadcast groups.

The layout (which group holds each layer, which rank decomposes each factor) is the placement policy's
(:mod:`.placement`) on the preconditioner's :class:`~.placement.GradWorkerGrid`; the collectives are one broadcast
per owning rank (:func:`~.collectives.broadcast_by_owner`).  Functions of a
:class:`~.preconditioner.KFACPreconditioner` (``pre``), which keeps the state.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from lightning_hpc.kfac.batched_decompositions import decompose_factors
from lightning_hpc.kfac.collectives import broadcast_by_owner
from lightning_hpc.kfac.kl_clip import kl_clip_factor
from lightning_hpc.kfac.layers import LayerHandler

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["decompose", "layout", "precondition_by_workers", "share_decompositions"]

Work = list[tuple[int, LayerHandler, str]]
Results = dict[tuple[str, str], dict[str, torch.Tensor]]


def layout(pre: KFACPreconditioner) -> tuple[list[int], dict[tuple[int, str], int]]:
    """Each layer's gradient-worker group (column of the grid) and ``(layer index, factor name) -> owning rank``;
    deterministic in the layer shapes and the grid, computed once."""
    if pre._layout_cache is None:
        dims = [h.layer_forms() for h in pre.handlers]
        pre._layout_cache = pre.placement_policy.assign_grid(dims, pre.grid)
    return pre._layout_cache


def decompose(pre: KFACPreconditioner, due: set[tuple[int, str]] | None = None) -> None:
    """Step 2 of Algorithm 1 for every factor of this rank's gradient-worker group, or for the ``(layer index,
    factor)`` pairs ``due``: each owning rank decomposes its factors as the factor's form says (those of one side
    length together), then shares them with the layer's other gradient workers (KAISA: the column; COMM-OPT: the
    world)."""
    world, rank = pre.comm.world_size, pre.comm.rank
    owners = pre.assignment()
    work = [(owners[(i, kind)], h, kind) for i, h in enumerate(pre.handlers) if h.factors and pre._is_worker(i)
            for kind in h.factor_forms() if due is None or (i, kind) in due]  # fmt: skip
    # factors of one side length in one batched eigh / inverse (:mod:`.batched_decompositions`)
    results = decompose_factors([(h.state, kind) for owner, h, kind in work if owner == rank], pre.method,
                                pre.damping, pre.decomposition_dtype, pre.inverse_dtype)
    if world > 1 and pre.grid.shares_decompositions:
        results = share_decompositions(pre, work, results, pre._column_group)
    for (name, kind), res in results.items():
        pre._by_name[name].state.set_decomposition(kind, res)


def share_decompositions(pre: KFACPreconditioner, work: Work, results: Results, group: Any = None) -> Results:
    """One broadcast per owning rank of all its decompositions within ``group`` (None: the world), all in flight
    at once (paper: allgather)."""
    items: dict[int, list[tuple[Hashable, dict[str, tuple[int, ...]]]]] = {}
    for owner, h, kind in work:
        items.setdefault(owner, []).append(((h.name, kind), h.state.result_shapes(kind, pre.method)))
    return broadcast_by_owner(  # type: ignore[return-value]
        pre.comm, items, results, pre.inverse_dtype, pre.comm_device(), group  # type: ignore[arg-type]
    )


def precondition_by_workers(pre: KFACPreconditioner, lr: float | None, kl_clip: float | None) -> torch.Tensor | None:
    """Step 3 under KAISA (K-FAC-lw at one worker per layer): in each broadcast group (row), the member of a
    layer's worker group preconditions the layer and broadcasts the result to the row (one buffer per source); every
    rank then scales the results by the KL clip's nu (Eq 18, returned; None: not clipped; the last one when no layer
    was preconditioned) and writes them back."""
    matrices = ((h, h.grad_matrix()) for h in pre.handlers if h.factors)
    grads: dict[str, torch.Tensor] = {h.name: g for h, g in matrices if g is not None}
    columns = pre.layer_columns()
    rank = pre.comm.rank
    items: dict[int, list[tuple[Hashable, dict[str, tuple[int, ...]]]]] = {}
    local: dict[Hashable, dict[str, torch.Tensor]] = {}
    mine: list[LayerHandler] = []
    for i, h in enumerate(pre.handlers):
        # Identical on every rank: gradients are allreduced and factors exist everywhere by now.
        if h.name not in grads:
            continue
        source = pre.grid.source(columns[i], rank)
        items.setdefault(source, []).append((h.name, {"p": tuple(grads[h.name].shape)}))
        if source == rank:
            if h.decompositions:
                mine.append(h)
            else:  # decomposition failed to exist: plain gradient, as the other layers' optimizer sees it
                local[h.name] = {"p": grads[h.name]}
    local.update({name: {"p": p} for name, p in pre._precondition_layers(mine, grads).items()})
    out = broadcast_by_owner(pre.comm, items, local, pre.decomposition_dtype, pre.comm_device(), pre._row_group)
    precond = {name: res["p"] for name, res in out.items()}
    layers = [h for h in pre.handlers if h.name in precond]
    if not layers:  # nothing preconditioned: the last nu stands
        return pre._last_nu
    nu = None
    if kl_clip:
        products = [(precond[h.name] * grads[h.name].to(precond[h.name].dtype)).sum().reshape(1) for h in layers]
        nu = kl_clip_factor(products, pre._lrs.squares(layers, lr, pre.optimizer, pre.lr, products[0].device), kl_clip)
    for h in layers:
        h.set_grad_matrix(precond[h.name] * nu if nu is not None else precond[h.name])  # type: ignore[arg-type]
    return nu
