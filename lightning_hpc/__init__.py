"""lightning_hpc: HPC training techniques for PyTorch Lightning.

Every public name is imported on first use (PEP 562), so ``import lightning_hpc`` and importing a plain-torch
core (``lightning_hpc.kfac.preconditioner``, ``lightning_hpc.spatial.layout.halo_exchange``, ...) neither imports
Lightning nor registers anything as a side effect.  The strategy names (``Trainer(strategy="layered_sgd")``)
are registered in Lightning's ``StrategyRegistry`` when ``lightning.pytorch`` is imported
(:mod:`lightning_hpc._registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_hpc._registration import register_when_lightning_is_imported

__version__ = "0.1.0"

#: public name -> module that defines it
_PUBLIC: dict[str, str] = {
    "KFAC": "lightning_hpc.kfac.callback",
    "KFACMixedPrecision": "lightning_hpc.kfac.precision",
    "KFACPreconditioner": "lightning_hpc.kfac.preconditioner",
    "ImageClassifier": "lightning_hpc.modules.classification",
    "SegmentationModule": "lightning_hpc.modules.segmentation",
    "HorovodStrategy": "lightning_hpc.horovod.strategy",  # importing it never imports Horovod
    "HybridParallelStrategy": "lightning_hpc.hybrid_fc.strategy",
    "LayeredSGDStrategy": "lightning_hpc.layered_sgd.strategy",
    "MultigridStrategy": "lightning_hpc.multigrid.strategy",
    "SpatialParallelStrategy": "lightning_hpc.spatial.lightning.strategy",
}

__all__ = [
    "HorovodStrategy",
    "HybridParallelStrategy",
    "ImageClassifier",
    "KFAC",
    "KFACMixedPrecision",
    "KFACPreconditioner",
    "LayeredSGDStrategy",
    "MultigridStrategy",
    "SegmentationModule",
    "SpatialParallelStrategy",
    "__version__",
]

if TYPE_CHECKING:
    from lightning_hpc.horovod.strategy import HorovodStrategy
    from lightning_hpc.hybrid_fc.strategy import HybridParallelStrategy
    from lightning_hpc.kfac.callback import KFAC
    from lightning_hpc.kfac.precision import KFACMixedPrecision
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner
    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy
    from lightning_hpc.modules.classification import ImageClassifier
    from lightning_hpc.modules.segmentation import SegmentationModule
    from lightning_hpc.multigrid.strategy import MultigridStrategy
    from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_hpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


register_when_lightning_is_imported()
