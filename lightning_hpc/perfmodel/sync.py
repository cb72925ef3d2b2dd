"""Cost of a synchronisation between ranks that are busy computing (measured on the running machine).

The alpha-beta model (Dryden et al. section V-A; :mod:`lightning_hpc.perfmodel.alphabeta`) is calibrated by a
ping-pong between otherwise idle ranks.  In a training step the ranks compute between two synchronisations
(halo exchange, batch-norm statistics, gradient allreduce) and do not arrive together: a rank waits until its
peer has finished its share and until the peer's communication thread gets a core, which on a node with no spare
core means until a compute thread gives one up.  Section V-A has no term for that; this module measures it.

What :func:`measure_sync` times (``P`` spawned gloo processes, one torch thread each, all at once; every loop
starts and ends with a barrier, so it lasts until the slowest rank is done, as a training step does):

* ``compute``: ``iters`` chunks of compute per rank: a 16-channel 3x3 convolution forward whose input side rank 0
  chooses so that one call takes about ``chunk_s`` in one process (all ranks use that side);
* ``allreduce`` / ``allgather`` / ``sendrecv``: the same loop with, after every chunk, an allreduce or an
  all-gather of ``small_bytes`` over the P ranks, or a nonblocking send + receive of ``small_bytes`` with the
  partner rank ``rank ^ 1`` and a wait (the shape of a halo exchange; rank ``P-1`` of an odd P has no partner);
* ``idle_*``: those synchronisations alone, back to back, no compute (for reference);
* with ``large_bytes > 0``: ``large``, a blocking allreduce of ``large_bytes`` after every chunk, and
  ``overlapped``, the same allreduce started asynchronously before the chunk and waited for after it.

The loops run interleaved ``rounds`` times; medians are kept.  ``allreduce_s = (allreduce - compute) / iters`` is
what one small allreduce adds to a busy loop (likewise ``allgather_s``, ``sendrecv_s``, ``large_allreduce_s``,
``large_overlapped_s``); ``chunk_s = compute / iters`` is the chunk's time with all P ranks computing.

How the spatial planner uses it (:class:`lightning_hpc.spatial.planner.CostModel`): every
synchronisation point is charged its alpha-beta cost plus :meth:`SyncCost.wait` = measured loaded cost of that
kind minus the alpha-beta cost of the calibration's own small message (never negative); a gradient allreduce costs
the larger of its alpha-beta cost and :meth:`SyncCost.gradient_allreduce` (the line through the small and large
loaded measurements); and only :attr:`SyncCost.overlap_fraction` of the allreduces' time may hide behind backward.
Nothing here is fitted to training-step times.  Results are cached per host, P and settings in
``$LIGHTNING_HPC_CACHE`` (default ``~/.cache/lightning_hpc``) like the alpha-beta calibration.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.p2p import exchange
from lightning_hpc.perfmodel import alphabeta
from lightning_hpc.perfmodel.alphabeta import AlphaBeta
from lightning_hpc.perfmodel.calibrate import cache_dir, cached_measurement
from lightning_hpc.perfmodel.layer_times import time_callable

__all__ = ["SyncCost", "measure_sync", "calibrate_sync"]


@dataclass(frozen=True)
class SyncCost:
    """Measured cost of synchronisations between ``world_size`` busy ranks (seconds; see the module doc)."""

    world_size: int
    chunk_s: float  # compute between two synchronisations, per rank, all ranks computing at once
    allreduce_s: float  # what one small allreduce adds to the busy loop
    sendrecv_s: float  # what one neighbour exchange adds to the busy loop
    idle_allreduce_s: float  # the same allreduce between idle ranks
    idle_sendrecv_s: float  # the same exchange between idle ranks
    small_bytes: int = 64
    allgather_s: float = 0.0  # what one small all-gather adds to the busy loop
    idle_allgather_s: float = 0.0  # the same all-gather between idle ranks
    large_bytes: int = 0  # size of the large-allreduce measurement (0: not measured)
    large_allreduce_s: float = 0.0  # a blocking allreduce of large_bytes after every chunk
    large_overlapped_s: float = 0.0  # the same allreduce started before the chunk, waited for after it

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def none(cls, world_size: int = 1) -> SyncCost:
        """No cost beyond alpha-beta (one process: nothing to synchronise)."""
        return cls(world_size, 0.0, 0.0, 0.0, 0.0, 0.0)

    def wait(self, kind: str, model: AlphaBeta, group: int | None = None) -> float:
        """What one synchronisation point of ``kind`` ("allreduce" / "allgather" for the small collectives,
        "sendrecv" for a halo exchange) costs under load beyond its alpha-beta cost: ``max(loaded -
        alpha-beta(small), 0)``, where alpha-beta(small) is the model's cost of the calibration's own small message
        (that collective over ``group`` ranks, default ``world_size``, or one send/recv)."""
        if kind == "allreduce":
            loaded, ab = self.allreduce_s, alphabeta.allreduce(self.small_bytes, group or self.world_size, model)
        elif kind == "allgather":
            p = group or self.world_size
            loaded, ab = self.allgather_s, alphabeta.allgather(self.small_bytes * p, p, model)
        elif kind == "sendrecv":
            loaded, ab = self.sendrecv_s, alphabeta.send_recv(self.small_bytes, model)
        else:
            raise ValueError(f"sync kind must be 'allreduce', 'allgather' or 'sendrecv', got {kind!r}")
        return max(loaded - ab, 0.0)

    def gradient_allreduce(self, nbytes: float) -> float:
        """A blocking allreduce of ``nbytes`` after compute, under load: the line through the measured small
        (``small_bytes``, ``allreduce_s``) and large (``large_bytes``, ``large_allreduce_s``) points; without the
        large measurement, the small one (a latency floor)."""
        if nbytes <= 0 or self.world_size <= 1:
            return 0.0
        if self.large_bytes <= self.small_bytes:
            return self.allreduce_s
        slope = max(self.large_allreduce_s - self.allreduce_s, 0.0) / (self.large_bytes - self.small_bytes)
        return self.allreduce_s + slope * max(nbytes - self.small_bytes, 0.0)

    @property
    def overlap_fraction(self) -> float:
        """Share of a large allreduce's loaded cost that computation can hide when it runs asynchronously
        (``1 - large_overlapped_s / large_allreduce_s``, in [0, 1]; 1 when not measured, as section V-B assumes)."""
        if self.large_bytes <= 0 or self.large_allreduce_s <= 0:
            return 1.0
        return min(max(1.0 - self.large_overlapped_s / self.large_allreduce_s, 0.0), 1.0)


def _chunk_side(chunk_s: float) -> int:
    """Input side of a 16-channel 3x3 convolution (batch 1) whose forward takes about ``chunk_s`` in this
    process: time a 64 x 64 input, scale the side by the square root of the ratio (cost ~ side^2), time again."""
    conv = nn.Conv2d(16, 16, 3, padding=1)
    side = 64
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(1, 16, side, side)
            t = time_callable(lambda: conv(x), warmup=1, repeats=5)
            side = int(min(max(side * (chunk_s / max(t, 1e-7)) ** 0.5, 4), 2048))
    return side


def _sync_worker(
    rank: int, world_size: int, chunk_s: float, iters: int, rounds: int, small_bytes: int, large_bytes: int
) -> dict[str, list[float]]:
    torch.manual_seed(rank)
    side = torch.tensor([_chunk_side(chunk_s) if rank == 0 else 0])
    dist.broadcast(side, 0)  # every rank computes the same chunk (rank 0's choice, sized while the others wait)
    conv, x = nn.Conv2d(16, 16, 3, padding=1), torch.randn(1, 16, int(side), int(side))
    small = torch.zeros(max(small_bytes // 4, 1))
    recv = torch.empty_like(small)
    large = torch.zeros(max(large_bytes // 4, 1)) if large_bytes > 0 else None
    partner = rank ^ 1 if (rank ^ 1) < world_size else None

    gathered = [torch.empty_like(small) for _ in range(world_size)]

    def allreduce() -> None:
        dist.all_reduce(small)

    def allgather() -> None:
        dist.all_gather(gathered, small)

    def sendrecv() -> None:
        if partner is not None:
            for work in exchange([(small, partner, 0)], [(recv, partner, 0)], None):  # as the halo exchanges post
                work.wait()

    def busy(sync):
        def loop() -> None:
            for _ in range(iters):
                conv(x)
                sync()
        return loop

    def idle(sync):
        def loop() -> None:
            for _ in range(iters):
                sync()
        return loop

    def compute() -> None:
        for _ in range(iters):
            conv(x)

    def overlapped() -> None:
        for _ in range(iters):
            work = dist.all_reduce(large, async_op=True)
            conv(x)
            work.wait()

    variants = {
        "compute": compute,
        "allreduce": busy(allreduce),
        "allgather": busy(allgather),
        "sendrecv": busy(sendrecv),
        "idle_allreduce": idle(allreduce),
        "idle_allgather": idle(allgather),
        "idle_sendrecv": idle(sendrecv),
    }
    if large is not None:
        variants |= {"large": busy(lambda: dist.all_reduce(large)), "overlapped": overlapped}
    out: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for fn in variants.values():  # warm-up: connections, allocator
            fn()
        for _ in range(rounds):  # variants interleaved, so slow drifts of the machine hit all of them
            for name, fn in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()  # a loop ends when the slowest rank ends (as a training step does)
                out[name].append(time.perf_counter() - t0)
    return out


def _summarise(
    world_size: int, iters: int, small_bytes: int, large_bytes: int, times: dict[str, list[float]]
) -> SyncCost:
    med = {k: statistics.median(v) for k, v in times.items()}
    extra = lambda name: max((med[name] - med["compute"]) / iters, 0.0)  # noqa: E731
    return SyncCost(
        world_size=world_size,
        chunk_s=med["compute"] / iters,
        allreduce_s=extra("allreduce"),
        sendrecv_s=extra("sendrecv"),
        idle_allreduce_s=med["idle_allreduce"] / iters,
        idle_sendrecv_s=med["idle_sendrecv"] / iters,
        small_bytes=small_bytes,
        allgather_s=extra("allgather"),
        idle_allgather_s=med["idle_allgather"] / iters,
        large_bytes=large_bytes,
        large_allreduce_s=extra("large") if large_bytes else 0.0,
        large_overlapped_s=extra("overlapped") if large_bytes else 0.0,
    )


def _check_args(world_size: int, chunk_s: float, iters: int, rounds: int, small_bytes: int, large_bytes: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if chunk_s <= 0 or iters < 1 or rounds < 1 or small_bytes < 4 or large_bytes < 0 or 0 < large_bytes <= small_bytes:
        raise ValueError(
            "sync calibration needs chunk_s > 0, iters >= 1, rounds >= 1, small_bytes >= 4 and large_bytes = 0 or > "
            f"small_bytes; got chunk_s={chunk_s}, iters={iters}, rounds={rounds}, small_bytes={small_bytes}, "
            f"large_bytes={large_bytes}"
        )


def measure_sync(world_size: int, chunk_s: float = 1e-3, iters: int = 40, rounds: int = 5, small_bytes: int = 64,
                 large_bytes: int = 4 << 20) -> SyncCost:
    """Measure :class:`SyncCost` between ``world_size`` local gloo processes spawned for the purpose (one torch
    thread each; what is timed: see the module doc).  Uncached; :func:`calibrate_sync` caches."""
    _check_args(world_size, chunk_s, iters, rounds, small_bytes, large_bytes)
    if world_size == 1:
        return SyncCost.none(1)
    from lightning_hpc.distributed.spawn import run_in_processes

    per_rank = run_in_processes(
        _sync_worker,
        world_size,
        chunk_s,
        iters,
        rounds,
        small_bytes,
        large_bytes,
        timeout_s=900,
        collective_timeout_s=300,
    )
    return _summarise(world_size, iters, small_bytes, large_bytes, per_rank[0])  # barriers: every rank sees the same


def _cache_path(world_size: int, chunk_s: float, iters: int, rounds: int, small_bytes: int, large_bytes: int) -> Path:
    host = socket.gethostname()
    return cache_dir() / (
        f"sync-v2-{host}-gloo-{world_size}-{chunk_s * 1e3:g}ms-{iters}x{rounds}-{small_bytes}-{large_bytes}.json"
    )


def calibrate_sync(world_size: int, chunk_s: float = 1e-3, iters: int = 40, rounds: int = 5, small_bytes: int = 64,
                   large_bytes: int = 4 << 20, use_cache: bool = True) -> SyncCost:
    """:func:`measure_sync`, cached in ``$LIGHTNING_HPC_CACHE`` (default ``~/.cache/lightning_hpc``) per host,
    ``world_size`` and settings, so a planner measures once per machine (``use_cache=False`` re-measures and
    overwrites the entry)."""
    _check_args(world_size, chunk_s, iters, rounds, small_bytes, large_bytes)
    if world_size == 1:
        return SyncCost.none(1)
    return cached_measurement(
        _cache_path(world_size, chunk_s, iters, rounds, small_bytes, large_bytes),
        SyncCost,
        lambda: measure_sync(world_size, chunk_s, iters, rounds, small_bytes, large_bytes),
        use_cache,
    )
