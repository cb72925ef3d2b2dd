"""The op-decision cache of one spatial grid: what the op dispatch decides for an op from its call's layouts,
shapes and non-tensor arguments alone (which kernel, which halo plan, which operand is cut or broadcast, the
output layout) is made once per distinct call and replayed on every later call with the same key, as DTensor
caches its sharding propagation per (op, input specs).

The cache belongs to the :class:`~lightning_hpc.spatial.layout.tiling.SpatialGrid` its decisions were made for (a
decision holds that grid's halo plans), so two grids in one process, e.g. two Trainers with different splits,
never share one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from lightning_hpc._compat import untraced
from lightning_hpc.spatial.layout.tracing import Trace


class DecisionCache:
    """Decisions by key; :attr:`made` counts the decisions actually derived (cache misses), the figure that a
    repeated step must leave unchanged."""

    __slots__ = ("table", "made")

    def __init__(self) -> None:
        self.table: dict[Hashable, Any] = {}
        self.made = 0

    def get(self, key: Hashable, decide: Callable[[], Any]) -> Any:
        """The decision for ``key``, derived by ``decide()`` the first time.  A ``decide`` that raises caches
        nothing (the next call raises again)."""
        try:
            return self.table[key]
        except KeyError:
            pass
        if Trace.active:
            # a decision depends on layouts and arguments only (it is replayed on other steps' values): while a
            # step is traced its tensors (index tables, weights) are made outside the trace, constants of the graph
            with untraced():
                decision = decide()
        else:
            decision = decide()
        self.table[key] = decision
        self.made += 1
        return decision

    def clear(self) -> None:
        self.table.clear()
