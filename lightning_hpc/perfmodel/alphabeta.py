"""Alpha-beta communication model and collective costs (Thakur, Rabenseifner & Gropp, IJHPCA 2005).

A message of ``n`` bytes between two ranks costs ``alpha + n * beta`` seconds (latency, inverse bandwidth);
``gamma`` is the per-byte cost of the local reduction.  The collective formulas are the ones the spatial
parallelism paper (Dryden et al., section V-A) uses for its performance model; the multigrid projections use
the same functions.  All sizes are in bytes, all times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["AlphaBeta", "send_recv", "broadcast", "reduce", "allgather", "reduce_scatter", "allreduce", "alltoall"]


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    gamma: float = 0.0  # seconds per byte reduced

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _check(p: int) -> None:
    if p < 1:
        raise ValueError(f"number of processes must be >= 1, got {p}")


def send_recv(n: float, m: AlphaBeta) -> float:
    """Point-to-point message: alpha + n beta."""
    return m.alpha + n * m.beta if n > 0 else 0.0


def broadcast(n: float, p: int, m: AlphaBeta) -> float:
    """Binomial tree for short messages, scatter + ring allgather (van de Geijn) for long ones; the cheaper."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    lg = math.ceil(math.log2(p))
    tree = lg * (m.alpha + n * m.beta)
    scatter_allgather = (lg + p - 1) * m.alpha + 2 * (p - 1) / p * n * m.beta
    return min(tree, scatter_allgather)


def reduce(n: float, p: int, m: AlphaBeta) -> float:
    """Binomial tree reduce: ceil(log p)(alpha + n beta + n gamma)."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    return math.ceil(math.log2(p)) * (m.alpha + n * m.beta + n * m.gamma)


def allgather(n: float, p: int, m: AlphaBeta) -> float:
    """Ring allgather; ``n`` is the size of the *gathered* result: (p-1) alpha + (p-1)/p n beta."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    return (p - 1) * m.alpha + (p - 1) / p * n * m.beta


def reduce_scatter(n: float, p: int, m: AlphaBeta) -> float:
    """Pairwise-exchange reduce-scatter of an ``n``-byte input: (p-1) alpha + (p-1)/p n (beta + gamma)."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    return (p - 1) * m.alpha + (p - 1) / p * n * (m.beta + m.gamma)


def allreduce(n: float, p: int, m: AlphaBeta) -> float:
    """The cheaper of recursive doubling (short) and Rabenseifner's reduce-scatter + allgather (long)."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    lg = math.ceil(math.log2(p))
    doubling = lg * (m.alpha + n * m.beta + n * m.gamma)
    rabenseifner = 2 * lg * m.alpha + 2 * (p - 1) / p * n * m.beta + (p - 1) / p * n * m.gamma
    return min(doubling, rabenseifner)


def alltoall(n: float, p: int, m: AlphaBeta) -> float:
    """Pairwise all-to-all where each rank holds ``n`` bytes in total: (p-1)(alpha + n/p beta)."""
    _check(p)
    if p == 1 or n <= 0:
        return 0.0
    return (p - 1) * (m.alpha + n / p * m.beta)
