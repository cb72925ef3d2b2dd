"""How much slower local compute runs when several processes share the node (measured, not assumed).

The layer times of :class:`~lightning_hpc.perfmodel.LayerTimer` are taken by one process.  When ``P`` ranks
share the cores (more ranks than cores, or a node shared with other jobs), every rank computes slower; planners
multiply their compute estimates by this factor.  On a node with a core or GPU per rank it measures about 1.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.perfmodel.layer_times import time_callable

__all__ = ["compute_contention"]


def _alone_and_together(
    rank: int, world_size: int, size: int, channels: int, repeats: int, rounds: int
) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, channels, 3, padding=1)
    x = torch.randn(1, channels, size, size)
    out = []
    with torch.no_grad():
        conv(x)
        for _ in range(rounds):
            dist.barrier()
            alone = time_callable(lambda: conv(x), warmup=1, repeats=repeats) if rank == 0 else 0.0  # others wait
            dist.barrier()  # then everyone at once, timed barrier to barrier: a bulk-synchronous step ends when
            conv(x)  # the slowest rank ends, and a rank that finishes early stops competing for the cores
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(repeats):
                conv(x)
            dist.barrier()
            out.append((alone, (time.perf_counter() - t0) / repeats))
    return out


def compute_contention(
    world_size: int, size: int = 256, channels: int = 32, repeats: int = 3, rounds: int = 3
) -> float:
    """Time per convolution with ``world_size`` local processes running ``repeats`` of them at once, from a
    barrier until the slowest process is done (as a bulk-synchronous training step), over its time in one process
    while the others wait (>= 1; median over rounds).  Spawns ``world_size`` gloo
    processes, one torch thread each; 1.0 for a single process.  The default workload (a 32-channel 3x3 convolution
    on 256 x 256, tens of milliseconds per call) is long enough to see the scheduler share the cores."""
    from lightning_hpc.distributed.spawn import run_in_processes

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 1.0
    results = run_in_processes(_alone_and_together, world_size, size, channels, repeats, rounds)
    ratios = [statistics.median(r[k][1] for r in results) / results[0][k][0] for k in range(rounds)]
    return max(1.0, statistics.median(ratios))
