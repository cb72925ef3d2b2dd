"""Measure alpha and beta of the running machine's interconnect with a short ping-pong.

Rank 0 and rank 1 exchange messages of growing size; half the round-trip time against the size is fitted by
least squares to ``alpha + n * beta``.  Results are cached per (backend, world size, host) in
``$LIGHTNING_HPC_CACHE`` (default ``~/.cache/lightning_hpc``) so planners do not re-measure.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_hpc.perfmodel.alphabeta import AlphaBeta

T = TypeVar("T")

__all__ = ["cache_dir", "cached_measurement", "read_cache", "write_cache", "machine_fingerprint", "fit_alpha_beta",
           "pingpong", "calibrate", "calibrate_local"]  # fmt: skip

DEFAULT_SIZES = tuple(2**k for k in range(4, 23, 2))  # 16 B .. 4 MiB


def cache_dir() -> Path:
    path = Path(os.environ.get("LIGHTNING_HPC_CACHE", Path.home() / ".cache" / "lightning_hpc"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_cache(path: Path) -> dict | None:
    """The JSON object in ``path``; None when the file is missing or unreadable (a cut-off write, another
    format), with a warning for the latter: a bad cache file costs a re-measurement, never a crash."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(
            f"lightning_hpc: ignoring unreadable cache file {path} ({e}); measuring again", RuntimeWarning, stacklevel=2
        )
        return None
    return data if isinstance(data, dict) else None


def write_cache(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a per-process temporary file, then ``os.replace``): ranks or jobs
    sharing a cache directory (a cluster's shared home) never read a half-written file."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def machine_fingerprint(device: torch.device | str = "cpu") -> str:
    """What a measured time depends on besides the workload: host, device model, torch version. Part of every
    cache key, so a cache in a shared home directory is not reused across node types or after an upgrade."""
    return _fingerprint(torch.device(device))


@functools.cache  # read once per device: it is part of every layer-time lookup
def _fingerprint(device: torch.device) -> str:
    if device.type == "cuda":
        model = torch.cuda.get_device_name(device)
    else:
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
        except OSError:
            pass
    return f"{socket.gethostname()}|{model}|torch={torch.__version__}"


def _load_cached(path: Path, cls: Callable[..., T]) -> T | None:
    """``cls(**entry)`` of the cache file ``path``; None if it is missing, unreadable or written by another version
    of the package (fields ``cls`` does not take)."""
    entry = read_cache(path)
    if entry is None:
        return None
    try:
        return cls(**entry)
    except TypeError:
        return None


def cached_measurement(path: Path, cls: Callable[..., T], measure: Callable[[], T], use_cache: bool = True) -> T:
    """``cls(**entry)`` from the JSON cache file ``path`` when it exists, is readable and fits ``cls`` (and
    ``use_cache``), else ``measure()``, written there atomically with its ``to_dict()``: how every calibration of
    this package is cached per machine."""
    cached = _load_cached(path, cls) if use_cache else None
    if cached is not None:
        return cached
    result = measure()
    write_cache(path, result.to_dict())  # type: ignore[attr-defined]
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


def pingpong(
    sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 20, warmup: int = 3
) -> tuple[list[float], list[float]]:
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
    """Alpha-beta of the current process group (collective); every rank gets rank 0's result.

    Rank 0 alone decides between its cache and a measurement and tells the others: ranks on different hosts have
    different cache files, and if each decided for itself, a rank with a cache would skip the ping-pong its
    peers wait in (a hang until the collective timeout)."""
    backend, world = dist.get_backend(), dist.get_world_size()
    if world < 2:
        raise ValueError("calibration needs at least 2 ranks")
    path = _cache_key(backend, world)
    cached = _load_cached(path, AlphaBeta) if dist.get_rank() == 0 and use_cache else None
    box: list[dict | None] = [cached.to_dict() if cached is not None else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        return AlphaBeta(**box[0])
    sizes, times = pingpong()
    box = [fit_alpha_beta(sizes, times).to_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    fit = AlphaBeta(**box[0])  # type: ignore[arg-type]
    if dist.get_rank() == 0:
        write_cache(path, fit.to_dict())
    return fit


def _calibrate_worker(rank: int, world_size: int) -> dict[str, float]:
    return calibrate(use_cache=False).to_dict()


def calibrate_local(world_size: int = 2, use_cache: bool = True) -> AlphaBeta:
    """Calibrate gloo between ``world_size`` local processes (spawned for the purpose), cached."""
    from lightning_hpc.distributed.spawn import run_in_processes

    return cached_measurement(
        _cache_key("gloo", world_size),
        AlphaBeta,
        lambda: AlphaBeta(**run_in_processes(_calibrate_worker, world_size)[0]),
        use_cache,
    )
