"""Empirical compute times of layers, measured per shape (warm-up, then the mean of several runs), cached.

The spatial planner (Dryden et al. section V-B measures convolution times rather than modelling them) and the
multigrid projections both read layer times from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from lightning_hpc.perfmodel.calibrate import (
    cache_dir,
    machine_fingerprint,
    read_cache,
    write_cache,
)

__all__ = ["time_callable", "LayerTimer"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callable(
    fn: Callable[[], object], warmup: int = 2, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Mean wall time in seconds of ``fn()`` after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


class LayerTimer:
    """Forward and forward+backward times of a module for an input shape, cached on disk by a key of
    (module repr, input shape, dtype, device, threads, :func:`machine_fingerprint`: host, device model, torch
    version). The cache file is rewritten atomically, and an unreadable one is ignored (re-measured)."""

    def __init__(self, cache_file: str | Path | None = None, warmup: int = 2, repeats: int = 5) -> None:
        self.path = Path(cache_file) if cache_file else cache_dir() / "layer_times.json"
        self.warmup, self.repeats = warmup, repeats
        self._cache: dict[str, dict[str, float]] = read_cache(self.path) or {}

    def _key(self, module: nn.Module, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> str:
        threads = torch.get_num_threads()
        return f"{module!r}|{tuple(shape)}|{dtype}|{device}|threads={threads}|{machine_fingerprint(device)}"

    def measure(
        self,
        module: nn.Module,
        input_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> dict[str, float]:
        """Return ``{"forward": s, "backward": s}`` (backward = input and weight gradients)."""
        device = torch.device(device)
        key = self._key(module, input_shape, dtype, device)
        if key in self._cache:
            return self._cache[key]
        module = module.to(device=device, dtype=dtype)
        x = torch.randn(*input_shape, device=device, dtype=dtype, requires_grad=True)
        with torch.no_grad():
            fwd = time_callable(lambda: module(x), self.warmup, self.repeats, device)
        y = module(x)
        grad = torch.randn_like(y)

        def fwd_bwd() -> None:
            module.zero_grad(set_to_none=True)
            torch.autograd.backward(module(x), grad)

        both = time_callable(fwd_bwd, self.warmup, self.repeats, device)
        entry = {"forward": fwd, "backward": max(both - fwd, 0.0)}
        # Entries other processes added since we loaded the file are kept (merge, then one atomic replace).
        self._cache = {**(read_cache(self.path) or {}), **self._cache, key: entry}
        write_cache(self.path, self._cache)
        return entry
