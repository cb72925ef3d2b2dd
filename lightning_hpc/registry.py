"""Registration of lightning_hpc's strategy names in Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["register_strategy", "register_strategies", "STRATEGIES"]

#: names this package registered -> strategy class
STRATEGIES: dict[str, type] = {}


def register_strategy(name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``name`` (lowercase) unless it is already there (guarded: re-imports are harmless)."""
    name = name.lower()
    STRATEGIES[name] = cls
    if name in StrategyRegistry:
        return
    StrategyRegistry.register(name, cls, description=description, **init_params)


def register_strategies() -> None:
    """Import each strategy module; each registers itself at import."""
    import importlib

    for module in STRATEGY_MODULES:
        importlib.import_module(module)


#: modules whose import registers a strategy (filled as strategies land)
STRATEGY_MODULES: list[str] = [
    "lightning_hpc.strategies.horovod",
    "lightning_hpc.strategies.layered_sgd",
    "lightning_hpc.strategies.multigrid.strategy",
    "lightning_hpc.strategies.hybrid_fc",
    "lightning_hpc.strategies.spatial.strategy",
]
