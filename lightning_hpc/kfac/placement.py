"""Which rank computes which decomposition (paper section IV-B, VI-C3, VI-C4).

A *factor* is the A or G matrix of one registered layer; its work estimate is ``n^3`` (eigendecomposition and
inversion of an ``n x n`` matrix are both cubic) and its payload ``n^2`` elements.

Policies
--------
``round_robin``
    The SC20 code's rule: walk the layers in model order with a rank counter that restarts at 0 on every
    update; a layer's A goes to the next rank, and its G to the rank after that only when the world size exceeds
    the number of layers, otherwise to the same rank as A.
``layer_wise``
    K-FAC-lw (section VI-C3, Osawa et al.): layer ``i`` goes, with both factors, to rank ``i mod world``; that
    rank also computes the layer's preconditioned gradient and broadcasts it.
``balanced``
    Greedy longest-processing-time-first on the ``n^3`` estimates (the policy section VI-C4 proposes): factors
    in decreasing cost, each to the currently least loaded rank. LPT is within 4/3 of the optimum in the worst
    case; on the model zoo it lands within 5% of the lower bound ``max(largest factor, total / world)``
    (checked by the tests and by ``bench/kfac_placement.py``).

Gradient workers (KAISA)
------------------------
``grad_worker_fraction`` (KAISA, Pauloski et al., SC21, arXiv:2107.01739: HYBRID-OPT) is the fraction of ranks that hold
each layer's decompositions and compute its preconditioned gradient. :class:`GradWorkerGrid` lays the ranks out
as ``grad_workers`` rows of ``num_groups = world / grad_workers`` contiguous ranks: a *column* (ranks ``c, c + C,
c + 2C, ...``) is a gradient-worker group, a *row* a broadcast group. Each layer belongs to one column
(:meth:`Placement.assign_layers`); its factors are decomposed by members of that column
(:meth:`Placement.assign` over the column's layers and ranks), the decompositions are broadcast within the
column, and every row receives the layer's preconditioned gradient from its member in that column. A fraction of
``1 / world`` is MEM-OPT (one worker per layer: ``layer_wise``'s K-FAC-lw), ``1`` is COMM-OPT (every rank holds
every decomposition: the SC20 scheme), values in between are HYBRID-OPT. Rows are contiguous ranks (usually one
node), so the per-step gradient broadcasts stay inside a node and only the rarer decomposition broadcasts cross
nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_hpc.kfac.forms import LayerDims, layer_forms

__all__ = [
    "PLACEMENTS",
    "BalancedPlacement",
    "Factor",
    "GradWorkerGrid",
    "LayerWisePlacement",
    "Placement",
    "RoundRobinPlacement",
    "assign_factors",
    "check_grad_worker_fraction",
    "check_placement",
    "grad_workers_for",
    "make_placement",
    "placement_summary",
]  # fmt: skip

PLACEMENTS = ("round_robin", "layer_wise", "balanced")


@dataclass(frozen=True)
class Factor:
    """One factor: ``layer`` index in model order, ``kind`` its name (``"A"``, ``"G"``, ...), the ``cost`` of
    decomposing it (``n^3`` for a dense ``n x n`` factor, see :mod:`.forms`) and its stored elements."""

    layer: int
    kind: str
    cost: int
    numel: int


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"K-FAC placement must be one of {PLACEMENTS}, got {placement!r}")
    return placement


def check_grad_worker_fraction(fraction: float | None) -> float | None:
    """``fraction`` if it is None (the placement's default) or a number in (0, 1]; ``ValueError`` otherwise."""
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"K-FAC grad_worker_fraction must be in (0, 1] (1 / world size = MEM-OPT, 1 = COMM-OPT) or None (the "
            f"placement's default), got {fraction!r}"
        )
    return float(fraction)


def grad_workers_for(fraction: float, world_size: int) -> int:
    """The number of gradient workers per layer, ``world_size * fraction``, which must be an integer that divides
    ``world_size`` (``ValueError`` listing the valid fractions otherwise)."""
    check_grad_worker_fraction(fraction)
    workers = round(world_size * fraction)
    if abs(world_size * fraction - workers) > 1e-9 * max(1, world_size) or workers < 1 or world_size % workers != 0:
        valid = ", ".join(f"{d}/{world_size}" for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(
            f"K-FAC grad_worker_fraction={fraction!r} on {world_size} ranks gives {world_size * fraction:g} gradient "
            f"workers per layer: world_size * grad_worker_fraction must be an integer that divides the world size "
            f"(valid fractions for {world_size} ranks: {valid})"
        )
    return workers


@dataclass(frozen=True)
class GradWorkerGrid:
    """The KAISA layout of ``world_size`` ranks for ``grad_workers`` gradient workers per layer.

    ``num_groups`` (C) columns of ``grad_workers`` ranks each: column ``c`` = ranks ``c, c + C, ...`` (a gradient
    worker group); ``grad_workers`` rows of C contiguous ranks: row ``j`` = ranks ``j C .. j C + C - 1`` (a
    broadcast group: each row member of a layer's column sends that layer's preconditioned gradient to the row).
    """

    world_size: int
    grad_workers: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.grad_workers < 1 or self.world_size % self.grad_workers != 0:
            raise ValueError(f"{self.grad_workers} gradient workers do not divide a world of {self.world_size} ranks")

    @property
    def num_groups(self) -> int:
        """Number of gradient-worker groups (columns), ``world_size / grad_workers``."""
        return self.world_size // self.grad_workers

    def column_of(self, rank: int) -> int:
        return rank % self.num_groups

    def row_of(self, rank: int) -> int:
        return rank // self.num_groups

    def column(self, c: int) -> tuple[int, ...]:
        """The ranks of gradient-worker group ``c``, ascending."""
        return tuple(range(c, self.world_size, self.num_groups))

    def row(self, j: int) -> tuple[int, ...]:
        """The ranks of broadcast group ``j``, ascending."""
        return tuple(range(j * self.num_groups, (j + 1) * self.num_groups))

    def source(self, column: int, rank: int) -> int:
        """The member of ``column`` in ``rank``'s row: it sends that column's preconditioned gradients to ``rank``."""
        return self.row_of(rank) * self.num_groups + column

    @property
    def shares_decompositions(self) -> bool:
        """Decompositions are broadcast within columns (more than one worker per layer)."""
        return self.grad_workers > 1

    @property
    def broadcasts_gradients(self) -> bool:
        """Preconditioned gradients are broadcast within rows (some ranks are not workers of some layers)."""
        return self.num_groups > 1

    def make_groups(self, comm: Any) -> tuple[Any, Any]:
        """``comm.rank``'s gradient-worker group and broadcast group (``None``: the whole world or unused). Under
        HYBRID-OPT every rank creates every column group, then every row group, in the same order (group
        creation is collective); the communicator gives them the world's timeout."""
        if self.world_size == 1 or not (self.shares_decompositions and self.broadcasts_gradients):
            return None, None
        columns = [comm.new_group(self.column(c)) for c in range(self.num_groups)]
        rows = [comm.new_group(self.row(j)) for j in range(self.grad_workers)]
        return columns[self.column_of(comm.rank)], rows[self.row_of(comm.rank)]


def _factor_names(layer_dims: Sequence[LayerDims]) -> list[list[str]]:
    return [list(layer_forms(d).factors) for d in layer_dims]


def _round_robin(layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    spread_g = world_size > len(layer_dims)
    counter = 0  # restarts at 0 on every update: this function is called per update
    for i, kinds in enumerate(_factor_names(layer_dims)):
        # a layer's first factor (A) to the next rank; the others (G) to the ranks after it only when there are
        # more ranks than layers, else with the first
        first = counter % world_size
        counter += 1
        for j, kind in enumerate(kinds):
            if j == 0 or not spread_g:
                out[(i, kind)] = first
            else:
                out[(i, kind)] = counter % world_size
                counter += 1
    return out


def _layer_wise(layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
    return {(i, kind): i % world_size for i, kinds in enumerate(_factor_names(layer_dims)) for kind in kinds}


def _factors(layer_dims: Sequence[LayerDims]) -> list[Factor]:
    return [Factor(i, kind, form.cost, form.numel) for i, d in enumerate(layer_dims)
            for kind, form in layer_forms(d).factors.items()]  # fmt: skip


def _layer_cost(d: LayerDims) -> int:
    return sum(form.cost for form in layer_forms(d).factors.values())


def _balanced(layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
    factors = _factors(layer_dims)
    # Decreasing cost; ties broken by model order so every rank computes the same assignment.
    factors.sort(key=lambda f: (-f.cost, f.layer, f.kind))
    heap = [(0, r) for r in range(world_size)]  # (load, rank): least loaded first, lowest rank on ties
    out: dict[tuple[int, str], int] = {}
    for f in factors:
        load, rank = heapq.heappop(heap)
        out[(f.layer, f.kind)] = rank
        heapq.heappush(heap, (load + f.cost, rank))
    return out


def assign_factors(
    layer_dims: Sequence[LayerDims], world_size: int, placement: str = "balanced"
) -> dict[tuple[int, str], int]:
    """Map ``(layer index, factor name) -> rank`` for layers with factor sides ``layer_dims[i] = (n_A, n_G)``
    (or their :class:`~.forms.LayerForms`).

    Deterministic: every rank computes the same map without communicating.
    """
    policy = make_placement(placement)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return policy.assign(layer_dims, world_size)


def placement_summary(
    layer_dims: Sequence[LayerDims], world_size: int, assignment: dict[tuple[int, str], int]
) -> dict:
    """Per-rank factors, element counts (sum n^2 for dense factors) and costs (sum n^3), with max / mean /
    lower-bound cost."""
    ranks: list[dict[str, Any]] = [{"rank": r, "factors": [], "numel": 0, "cost": 0} for r in range(world_size)]
    costs: list[int] = []
    for f in _factors(layer_dims):
        r = assignment[(f.layer, f.kind)]
        ranks[r]["factors"].append(f"{f.layer}{f.kind}")
        ranks[r]["numel"] += f.numel
        ranks[r]["cost"] += f.cost
        costs.append(f.cost)
    total = sum(costs)
    max_cost = max(r["cost"] for r in ranks)
    lower = max(max(costs, default=0), total / world_size)
    return {
        "world_size": world_size,
        "ranks": ranks,
        "total_cost": total,
        "max_cost": max_cost,
        "mean_cost": total / world_size,
        "lower_bound_cost": lower,
        "max_over_mean": max_cost / (total / world_size) if total else 1.0,
        "max_over_lower_bound": max_cost / lower if lower else 1.0,
    }


class Placement:
    """A placement policy as an object (cf. kfac-pytorch's ``WorkAssignment``): which rank decomposes each
    factor and, with a gradient-worker fraction below 1 (KAISA), which group of ranks each layer belongs to.
    :attr:`owner_preconditions` says whether the policy's default fraction is ``1 / world`` (K-FAC-lw: the
    owner preconditions and broadcasts the result) rather than 1 (decompositions broadcast to every rank)."""

    name: str = ""
    #: the default gradient-worker fraction is 1 / world (MEM-OPT) instead of 1 (COMM-OPT)
    owner_preconditions: bool = False

    def assign(self, layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
        """``(layer index, factor name) -> rank``; deterministic, so every rank computes it without communicating."""
        raise NotImplementedError

    def assign_layers(self, layer_dims: Sequence[LayerDims], num_groups: int) -> list[int]:
        """The gradient-worker group (column) of each layer: ``i mod num_groups`` (model order); the balanced
        policy overrides it with LPT on the layers' decomposition cost ``n_A^3 + n_G^3``."""
        return [i % num_groups for i in range(len(layer_dims))]

    def default_grad_workers(self, world_size: int) -> int:
        return 1 if self.owner_preconditions else world_size

    def assign_grid(
        self, layer_dims: Sequence[LayerDims], grid: GradWorkerGrid
    ) -> tuple[list[int], dict[tuple[int, str], int]]:
        """``(column of each layer, (layer, factor name) -> rank)`` for the KAISA grid: layers go to columns by
        :meth:`assign_layers`, and each column's factors to its ranks by :meth:`assign` over the column's layers.
        With one column (fraction 1) this is :meth:`assign` over the world; with one rank per column (MEM-OPT) a
        layer's factors both go to its column's rank."""
        if grid.num_groups == 1:
            return [0] * len(layer_dims), self.assign(layer_dims, grid.world_size)
        columns = self.assign_layers(layer_dims, grid.num_groups)
        out: dict[tuple[int, str], int] = {}
        for c in range(grid.num_groups):
            members = grid.column(c)
            layers = [i for i, col in enumerate(columns) if col == c]
            local = self.assign([layer_dims[i] for i in layers], grid.grad_workers) if layers else {}
            for (j, kind), r in local.items():
                out[(layers[j], kind)] = members[r]
        return columns, out


class RoundRobinPlacement(Placement):
    name = "round_robin"

    def assign(self, layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
        return _round_robin(layer_dims, world_size)


class LayerWisePlacement(Placement):
    name = "layer_wise"
    owner_preconditions = True

    def assign(self, layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
        return _layer_wise(layer_dims, world_size)


class BalancedPlacement(Placement):
    name = "balanced"

    def assign(self, layer_dims: Sequence[LayerDims], world_size: int) -> dict[tuple[int, str], int]:
        return _balanced(layer_dims, world_size)

    def assign_layers(self, layer_dims: Sequence[LayerDims], num_groups: int) -> list[int]:
        # LPT on whole layers (both factors of a layer must live in one column), ties in model order
        costs = [_layer_cost(d) for d in layer_dims]
        order = sorted(range(len(layer_dims)), key=lambda i: (-costs[i], i))
        heap = [(0, c) for c in range(num_groups)]
        out = [0] * len(layer_dims)
        for i in order:
            load, c = heapq.heappop(heap)
            out[i] = c
            heapq.heappush(heap, (load + costs[i], c))
        return out


_POLICIES: dict[str, type[Placement]] = {
    "round_robin": RoundRobinPlacement,
    "layer_wise": LayerWisePlacement,
    "balanced": BalancedPlacement,
}


def make_placement(placement: str) -> Placement:
    return _POLICIES[check_placement(placement)]()
