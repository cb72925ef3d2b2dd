"""Deprecated location of the strategy classes: they live in their technique's folder
(``lightning_hpc.layered_sgd.strategy``, ...) and are public as ``lightning_hpc.LayeredSGDStrategy`` etc.
This module re-exports them lazily for one release."""

from __future__ import annotations

from typing import Any

__all__ = [
    "HorovodStrategy",
    "HybridParallelStrategy",
    "LayeredSGDStrategy",
    "MultigridStrategy",
    "SpatialParallelStrategy",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import lightning_hpc

        return getattr(lightning_hpc, name)
    raise AttributeError(f"module 'lightning_hpc.strategies' has no attribute {name!r}")
