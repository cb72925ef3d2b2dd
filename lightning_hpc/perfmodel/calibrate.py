"""Measure alpha and beta of the running machine's interconnect with a short ping-pong.

Rank 0 and rank 1 exchange messages of growing size; half the round-trip time against the size is fitted by
least squares to ``alpha + n * beta``.  Results are cached per (backend, world size, host) in
``$LIGHTNING_HPC_CACHE`` (default ``~/.cache/lightning_hpc``) so planners do not re-measure.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_hpc.perfmodel.alphabeta import AlphaBeta

T = TypeVar("T")

__all__ = ["cache_dir", "cached_measurement", "fit_alpha_beta", "pingpong", "calibrate", "calibrate_local"]

DEFAULT_SIZES = tuple(2**k for k in range(4, 23, 2))  # 16 B .. 4 MiB


def cache_dir() -> Path:
    path = Path(os.environ.get("LIGHTNING_HPC_CACHE", Path.home() / ".cache" / "lightning_hpc"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_measurement(path: Path, cls: Callable[..., T], measure: Callable[[], T], use_cache: bool = True) -> T:
    """``cls(**entry)`` from the JSON cache file ``path`` when it exists (and ``use_cache``), else ``measure()``,
    written there with its ``to_dict()``: how every calibration of this package is cached per machine."""
    if use_cache and path.exists():
        return cls(**json.loads(path.read_text()))
    result = measure()
    path.write_text(json.dumps(result.to_dict()))  # type: ignore[attr-defined]
    return result


def fit_alpha_beta(sizes: list[float], times: list[float]) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + n beta``; both coefficients clamped to be non-negative."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    x = torch.tensor(sizes, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    coef = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1)
    alpha, beta = float(coef[0]), float(coef[1])
    if beta <= 0:  # fall back to the largest message's bandwidth
        beta = times[-1] / sizes[-1]
    return AlphaBeta(alpha=max(alpha, 0.0), beta=beta)


def pingpong(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 20, warmup: int = 3) -> tuple[list[float], list[float]]:
    """One-way time per message size between ranks 0 and 1 (other ranks idle). Collective: all ranks call it."""
    rank = dist.get_rank()
    times: list[float] = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        elapsed = 0.0
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= warmup:
                elapsed += time.perf_counter() - t0
        times.append(elapsed / repeats / 2)
        dist.barrier()
    return [float(s) for s in sizes], times


def _cache_key(backend: str, world_size: int) -> Path:
    return cache_dir() / f"alphabeta-{socket.gethostname()}-{backend}-{world_size}.json"


def calibrate(use_cache: bool = True) -> AlphaBeta:
    """Alpha-beta of the current process group (collective); rank 0's fit is broadcast to all ranks."""
    backend, world = dist.get_backend(), dist.get_world_size()
    path = _cache_key(backend, world)
    if use_cache and path.exists():
        return AlphaBeta(**json.loads(path.read_text()))
    if world < 2:
        raise ValueError("calibration needs at least 2 ranks")
    sizes, times = pingpong()
    fit = fit_alpha_beta(sizes, times)
    packed = torch.tensor([fit.alpha, fit.beta], dtype=torch.float64)
    dist.broadcast(packed, 0)
    fit = AlphaBeta(alpha=float(packed[0]), beta=float(packed[1]))
    if dist.get_rank() == 0:
        path.write_text(json.dumps(fit.to_dict()))
    return fit


def _calibrate_worker(rank: int, world_size: int) -> dict[str, float]:
    return calibrate(use_cache=False).to_dict()


def calibrate_local(world_size: int = 2, use_cache: bool = True) -> AlphaBeta:
    """Calibrate gloo between ``world_size`` local processes (spawned for the purpose), cached."""
    from lightning_hpc.distributed.spawn import run_in_processes

    return cached_measurement(
        _cache_key("gloo", world_size), AlphaBeta, lambda: AlphaBeta(**run_in_processes(_calibrate_worker, world_size)[0]), use_cache
    )
