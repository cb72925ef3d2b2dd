"""Choice of column- or row-parallel layout for each fully-connected layer of the sharded head.

Each of the K ranks owns 1/K of every FC layer (Krizhevsky, "One weird trick", section 4: model parallelism in
the fully-connected layers).  A layer ``y = x W^T + b`` with ``W`` of shape (out, in) can be split two ways:

``col``  rank r owns rows ``W[o_r]`` (its block of *output* neurons) and ``b[o_r]``; it needs the full input
         (replicated, state ``R``) and produces its block of output neurons (state ``S``).
``row``  rank r owns columns ``W[:, i_r]`` (its block of *input* neurons) and ``b[o_r]``; it needs only its block
         of input neurons (``S``) and produces a partial sum over its inputs (state ``P``) that a reduce-scatter
         over neurons turns into ``S``.

Element-wise layers (ReLU, dropout) are applied on ``S`` only, so a dropout mask never has to agree between
ranks.  Transitions between layer i and i+1 (n examples, h_i neurons, per-rank bytes received, ring algorithms):

=========  =======================================  ===================
i -> i+1   communication                            elements received
=========  =======================================  ===================
col, row   none (S is what a row layer needs)       0
col, col   all-gather neurons (S -> R)              (K-1)/K n h_i
row, row   reduce-scatter neurons (P -> S)          (K-1)/K n h_i
row, col   reduce-scatter then all-gather           2 (K-1)/K n h_i
=========  =======================================  ===================

The head's input arrives replicated (every scheme gives each rank the whole sub-batch), so the first layer is
free either way (a row layer just slices its input block).  The output has to reach the rank that owns each
example: a final ``col`` layer sends each owner its C/K class slice of its rows, a final ``row`` layer
reduce-scatters the full C-wide partial sums, K times more data.  The backward pass mirrors every exchange
with the same volume, so minimising the forward bytes minimises the total.

:func:`plan_layout` enumerates the 2^L layouts (L is small: 2-4 layers) and keeps the cheapest; ties go to the
layout with fewer collectives, then to the lexicographically first (``col`` before ``row``).  For the one-tower
AlexNet head 9216-4096-4096-1000 it picks ``col, col, row`` (one all-gather of 4096 neurons, one reduce-scatter
of 1000 logits per example): 3822 elements per example at K=4 against 6332 for the classic alternating
``col, row`` pairing followed by a ``col`` output layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

__all__ = ["LAYOUTS", "plan_layout", "layout_cost"]

LAYOUTS = ("col", "row")


def _final_cost(kind: str, classes: int, k: int) -> float:
    # Output delivered to owners: col sends C/K of each example's classes to its owner ((K-1)/K of them
    # off-rank on average); row reduce-scatters the C-wide partial sums.
    if kind == "col":
        return (k - 1) / k * classes / k
    return (k - 1) / k * classes


def layout_cost(layouts: Sequence[str], widths: Sequence[int], k: int) -> tuple[float, int]:
    """(elements received per example per rank in the forward pass, number of collectives) of ``layouts``.

    ``widths`` = [in_0, out_0, out_1, ..., out_{L-1}] of the L linear layers.
    """
    if len(widths) != len(layouts) + 1:
        raise ValueError(f"need {len(layouts) + 1} widths for {len(layouts)} layers, got {len(widths)}")
    cost, calls = 0.0, 0
    f = (k - 1) / k
    for i in range(len(layouts) - 1):
        h = widths[i + 1]
        if layouts[i] == "row":
            cost, calls = cost + f * h, calls + 1
        if layouts[i + 1] == "col":
            cost, calls = cost + f * h, calls + 1
    cost += _final_cost(layouts[-1], widths[-1], k)
    return cost, calls + 1


def plan_layout(widths: Sequence[int], k: int, fixed: Mapping[int, str] | None = None) -> list[str]:
    """Cheapest layout (see the module docstring) for linear layers of widths ``widths`` on ``k`` ranks; ``fixed``
    (layer index -> layout) pins the layers that only one layout computes exactly (parametrized.py)."""
    n_layers = len(widths) - 1
    if n_layers < 1:
        raise ValueError("the head needs at least one linear layer")
    pinned = dict(fixed or {})
    best = min(
        (lay for lay in itertools.product(LAYOUTS, repeat=n_layers) if all(lay[i] == x for i, x in pinned.items())),
        key=lambda lay: (*layout_cost(lay, widths, max(k, 2)), lay),
    )
    return list(best)
