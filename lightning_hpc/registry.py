"""Registration of lightning_hpc's strategy names in Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["register_strategy", "register_strategies", "STRATEGIES"]

#: name -> (import path of the strategy class, description, default init kwargs)
STRATEGIES: dict[str, tuple[str, str, dict[str, Any]]] = {}


def register_strategy(name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``name`` (lowercase) unless it is already there (guarded: re-imports are harmless)."""
    name = name.lower()
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
    "lightning_hpc.strategies.spatial.strategy",
]
