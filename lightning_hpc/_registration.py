"""Register lightning_hpc's strategy names when Lightning is imported, not when lightning_hpc is.

``Trainer(strategy="layered_sgd")`` needs the name in Lightning's ``StrategyRegistry`` before the Trainer is
built, but importing a plain-torch core (``lightning_hpc.kfac.preconditioner``) must not import Lightning.  So
importing ``lightning_hpc`` only installs a tiny import hook: if ``lightning.pytorch.strategies`` is already
imported the names are registered at once, otherwise right after it is first imported.  The hook wraps only
that one module's loader and removes itself after it fired.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["register_when_lightning_is_imported"]

_WATCHED = "lightning.pytorch.strategies"


def _register() -> None:
    from lightning_hpc.registry import register_strategies

    register_strategies()


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register()


class _LightningImportHook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _WATCHED:
            return None
        sys.meta_path.remove(self)  # fire once; also keeps the lookup below from finding this hook again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_when_lightning_is_imported() -> None:
    """Register now if Lightning's strategies are imported, else install the one-shot hook (idempotent)."""
    if _WATCHED in sys.modules:
        _register()
        return
    if not any(isinstance(f, _LightningImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())
