"""Cost of layer-partitioned (model-parallel) execution: a serial pipeline over ranks and bulk-synchronous
phases, built on the alpha-beta messages of :mod:`lightning_hpc.perfmodel.alphabeta`.

Used by the multigrid projections (partitioned-model baseline, relaxation phases); generic to any scheme that
splits consecutive layers over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.perfmodel.alphabeta import AlphaBeta, send_recv

__all__ = ["stage_times", "serial_pipeline_time", "bulk_synchronous_time"]


def stage_times(layer_times: Sequence[float], parts: int) -> list[float]:
    """Compute time of each of ``parts`` contiguous stages (blocked partition of the layers)."""
    return [sum(layer_times[a:b]) for a, b in block_bounds(len(layer_times), parts)]


def serial_pipeline_time(layer_times: Sequence[float], parts: int, message_bytes: float, model: AlphaBeta) -> float:
    """One sample batch through layers split over ``parts`` ranks, evaluated one rank after the other
    (no micro-batching): all layer times plus ``parts - 1`` boundary messages."""
    return sum(layer_times) + (parts - 1) * send_recv(message_bytes, model)


def bulk_synchronous_time(
    per_rank_compute: Sequence[float], message_bytes: float, model: AlphaBeta, messages: int = 1
) -> float:
    """A phase where every rank computes, then exchanges ``messages`` boundary messages with a neighbour:
    the slowest rank's compute plus the messages (neighbour exchanges of all ranks overlap)."""
    return max(per_rank_compute) + messages * send_recv(message_bytes, model)
